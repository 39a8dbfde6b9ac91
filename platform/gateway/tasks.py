from celery import shared_task

from gateway import pins, services, unreported


@shared_task(name="gateway.check_engines")
def check_engines() -> int:
    return sum(engine.healthy for engine in services.engines_check())


@shared_task(name="gateway.prefetch_successor")
def prefetch_successor(old_digest: str | None, new_digest: str, new_path: str) -> list[str]:
    return services.adapter_prefetch_successor(old_digest=old_digest, new_digest=new_digest, new_path=new_path)


@shared_task(name="gateway.reconcile_admission")
def reconcile_admission() -> int:
    return services.admission_reconcile_all()


@shared_task(name="gateway.bill_unreported_usage")
def bill_unreported_usage() -> int:
    return unreported.unreported_usage_bill()


@shared_task(name="gateway.sync_pins")
def sync_pins() -> int:
    return pins.engine_pins_sync_all()
