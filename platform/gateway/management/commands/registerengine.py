from decimal import Decimal, InvalidOperation

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from gateway.services import engine_register
from tenancy.audit import Actor


def _price(value: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation:
        raise CommandError(f"--gpu-price-per-hour must be a decimal number, got {value!r}") from None


class Command(BaseCommand):
    help = "Register (or update) an engine the gateway routes to, and check its health once."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("url", help="Base URL of the engine's internal API, e.g. http://127.0.0.1:8100")
        parser.add_argument("--token", default="", help="Bearer token; empty means QUILT_ENGINE_TOKEN.")
        parser.add_argument("--pool", default="default")
        parser.add_argument("--gpu-price-per-hour", type=_price, default=Decimal(0))
        parser.add_argument("--disabled", action="store_true")

    def handle(self, *args, name, url, token, pool, gpu_price_per_hour, disabled, **options):
        try:
            engine = engine_register(
                actor=Actor.system(), name=name, url=url, token=token, pool=pool,
                gpu_price_per_hour=gpu_price_per_hour, enabled=not disabled,
            )  # fmt: skip
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from None
        status = "healthy" if engine.healthy else f"not answering ({engine.last_error})"
        self.stdout.write(f"engine {engine.name} at {engine.url} (pool {engine.pool}): {status}")
