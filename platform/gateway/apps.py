from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from gateway import receivers  # noqa: F401
        from gateway.selectors import engine_gpu_prices
        from metering.pricing import gpu_price_source_set

        gpu_price_source_set(engine_gpu_prices)
