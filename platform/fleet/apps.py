from django.apps import AppConfig


class FleetConfig(AppConfig):
    """The GPU fleet's economics for staff: cost per token, utilisation, break-even against an API price, capacity,
    from the engines' registrations (gateway.models) and the usage events (metering.models). No models of its own."""

    name = "fleet"
