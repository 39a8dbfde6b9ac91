from django.apps import AppConfig


class ApikeysConfig(AppConfig):
    name = "apikeys"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apikeys.auth_changes import connect_receivers

        connect_receivers()
