from django.apps import AppConfig


class FinetuningConfig(AppConfig):
    name = "finetuning"
    verbose_name = "Fine-tuning"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from billing.invoices import LINE_SOURCES
        from finetuning.billing_lines import training_lines

        LINE_SOURCES.append(training_lines)
