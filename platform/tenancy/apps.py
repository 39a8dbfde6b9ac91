from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "tenancy"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from tenancy.admin_audit import audit_every_admin

        audit_every_admin()  # the admin has registered every app's ModelAdmins by now (it is installed first)
