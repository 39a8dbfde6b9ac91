from django.urls import path

from gateway import internal_views

urlpatterns = [
    path("engines/heartbeat", internal_views.heartbeat, name="engine-heartbeat"),
]
