"""Websocket routes for the console's live updates."""

from django.urls import path

from console.consumers import EnginesConsumer, TenantConsumer

websocket_urlpatterns = [
    path("ws/t/<slug:slug>/", TenantConsumer.as_asgi()),
    path("ws/engines/", EnginesConsumer.as_asgi()),
]
