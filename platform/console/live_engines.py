"""Engine state, live: each save of an engine's row (the health check records state every few seconds) tells the
staff's engines pages to re-render their grid, through the channel layer (and the relay, in the demo)."""

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from gateway.models import Engine
from registry.broadcast import push

ENGINES_GROUP = "engines"
ENGINES_MESSAGE = "engines.changed"


@receiver(post_save, sender=Engine, dispatch_uid="console-engines-changed")
def engine_saved(sender, instance: Engine, **kwargs) -> None:
    transaction.on_commit(lambda: push(ENGINES_GROUP, {"type": ENGINES_MESSAGE}), robust=True)
