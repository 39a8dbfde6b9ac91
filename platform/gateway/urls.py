from django.urls import path

from gateway import health_views, views

urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("models", views.models, name="models"),
    path("models/<path:name>", views.model, name="model"),
    path("health", health_views.health, name="v1-health"),
]
