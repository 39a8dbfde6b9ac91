from django.urls import path

from finetuning import views

urlpatterns = [
    path("files", views.files, name="files"),
    path("files/<str:file_id>", views.file, name="file"),
    path("files/<str:file_id>/content", views.file_contents, name="file-content"),
    path("fine_tuning/jobs", views.jobs, name="fine-tuning-jobs"),
    path("fine_tuning/jobs/<str:job_id>", views.job, name="fine-tuning-job"),
    path("fine_tuning/jobs/<str:job_id>/cancel", views.job_cancellation, name="fine-tuning-job-cancel"),
    path("fine_tuning/jobs/<str:job_id>/events", views.job_event_list, name="fine-tuning-job-events"),
    path("fine_tuning/jobs/<str:job_id>/checkpoints", views.job_checkpoint_list, name="fine-tuning-job-checkpoints"),
]
