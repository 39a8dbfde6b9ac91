"""Who did something, and the audit row that records it (always inside the action's transaction)."""

from dataclasses import dataclass
from typing import Any

from django.db import transaction

from tenancy.models import AuditLog, Tenant


@dataclass(frozen=True)
class Actor:
    """The credential behind an action: a logged-in user, an API key, or the system (management commands)."""

    user: Any = None
    key: Any = None
    ip_address: str | None = None

    @classmethod
    def system(cls) -> "Actor":
        return cls()

    def __str__(self) -> str:
        if self.user is not None:
            return self.user.get_username()
        if self.key is not None:
            return f"key:{self.key.prefix}"
        return "system"


def audit_record(
    *,
    actor: Actor,
    action: str,
    target: Any,
    tenant: Tenant | None,
    before: dict | None = None,
    after: dict | None = None,
) -> AuditLog:
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record must run inside the action's transaction.atomic() block")
    return AuditLog.objects.create(
        actor_user=actor.user,
        actor_key=actor.key,
        tenant=tenant,
        action=action,
        target_type=type(target).__name__,
        target_id=str(target.pk),
        before=before,
        after=after,
        ip_address=actor.ip_address,
    )
