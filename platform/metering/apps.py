from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from metering import receivers  # noqa: F401 - connects them
