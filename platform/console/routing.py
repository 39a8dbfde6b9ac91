"""Websocket routes for the console's live updates."""

websocket_urlpatterns: list = []
