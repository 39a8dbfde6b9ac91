from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from console import live_engines, live_tenant  # noqa: F401  (connect the engine-state and tenant pushes)
