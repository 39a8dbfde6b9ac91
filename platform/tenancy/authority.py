"""What an actor may do in a tenant. The services ask; the one domain error, NotAllowed, is turned into a 403 by
the API's error handler (and by Django's for console pages: it is a PermissionDenied).

- A member acts with their membership's role; platform staff and the system (management commands) with full
  authority.
- An API key is never an owner. Its role is the one its scopes imply (`admin` -> admin, `inference` or
  `adapters:write` -> developer, `usage:read` -> viewer), capped by its creator's current role in the tenant:
  demoting or removing a member takes their keys' power with them.
- Roles are a ceiling for keys: nobody mints (or rotates into being) a key with scopes their own role lacks.
"""

from django.core.exceptions import PermissionDenied

from apikeys.models import Scope
from tenancy.audit import Actor
from tenancy.models import Membership, Tenant
from tenancy.roles import role_at_least

Role = Membership.Role

SCOPES_OF_ROLE = {
    Role.VIEWER: frozenset({Scope.USAGE_READ}),
    Role.DEVELOPER: frozenset({Scope.INFERENCE, Scope.ADAPTERS_WRITE, Scope.USAGE_READ}),
    Role.ADMIN: frozenset(Scope.values),
    Role.OWNER: frozenset(Scope.values),
}
_RANKED = [Role.VIEWER, Role.DEVELOPER, Role.ADMIN, Role.OWNER]


class NotAllowed(PermissionDenied):
    """The actor's role (or key) does not allow this. `code` is the API's error code."""

    def __init__(self, message: str, code: str = "insufficient_role"):
        super().__init__(message)
        self.message = message
        self.code = code


def _role_of_scopes(scopes: list[str]) -> str | None:
    if Scope.ADMIN in scopes:
        return Role.ADMIN
    if Scope.INFERENCE in scopes or Scope.ADAPTERS_WRITE in scopes:
        return Role.DEVELOPER
    if Scope.USAGE_READ in scopes:
        return Role.VIEWER
    return None


def _lower(first: str | None, second: str | None) -> str | None:
    if first is None or second is None:
        return None
    return first if _RANKED.index(first) <= _RANKED.index(second) else second


def has_full_authority(actor: Actor) -> bool:
    """Platform staff (logged in, not through a key) and the system."""
    if actor.key is not None:
        return False
    return actor.user is None or bool(actor.user.is_staff)


def actor_role(*, actor: Actor, tenant: Tenant) -> str | None:
    """The actor's real role in the tenant: None when they have none there."""
    if has_full_authority(actor):
        return Role.OWNER
    if actor.key is not None:
        if actor.key.tenant_id != tenant.pk:
            return None
        role = _role_of_scopes(actor.key.scopes)
        creator = actor.key.created_by
        if creator is None or creator.is_staff:
            return role
        return _lower(role, _membership_role(user=creator, tenant=tenant))
    return _membership_role(user=actor.user, tenant=tenant)


def _membership_role(*, user, tenant: Tenant) -> str | None:
    return Membership.objects.filter(user=user, tenant=tenant).values_list("role", flat=True).first()


def require_role(*, actor: Actor, tenant: Tenant, minimum: str, doing: str = "do this") -> str:
    """The actor's role, if it is at least `minimum`; else NotAllowed, whose message names what was refused:
    `doing` is a verb phrase ("read billing and invoices")."""
    role = actor_role(actor=actor, tenant=tenant)
    if role is None or not role_at_least(role, minimum):
        who = "An API key" if actor.key is not None and minimum == Role.OWNER else "You"
        raise NotAllowed(f"{who} may not {doing}: it needs the {minimum} role or higher.")
    return role


def require_scopes_within_role(*, actor: Actor, tenant: Tenant, scopes: list[str]) -> None:
    """A key's scopes never exceed what its maker may do (and a key never mints beyond its own scopes)."""
    role = actor_role(actor=actor, tenant=tenant)
    allowed = SCOPES_OF_ROLE.get(role, frozenset())
    if actor.key is not None and Scope.ADMIN not in actor.key.scopes:
        allowed = allowed & frozenset(actor.key.scopes)
    beyond = sorted(set(scopes) - allowed)
    if beyond:
        raise NotAllowed(f"Your role does not allow keys with the scopes: {', '.join(beyond)}.")


def require_owner_rule(*, actor: Actor, tenant: Tenant, roles: tuple[str, ...]) -> None:
    """Granting, taking away or removing the owner role is an owner's act (never a key's)."""
    if Role.OWNER in roles:
        require_role(actor=actor, tenant=tenant, minimum=Role.OWNER, doing="grant, take away or remove the owner role")


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
BILLING_SETTINGS = frozenset({"billing_email"})  # what a suspended or closed tenant may still change


def require_writable(*, tenant: Tenant, billing: bool = False) -> None:
    """A suspended or closed tenant is read-only, billing excepted (`billing`: the write is billing's)."""
    if not tenant.is_active and not billing:
        raise NotAllowed(f"The tenant {tenant.slug} is {tenant.status}: it is read-only, billing excepted.",
                         code="tenant_suspended")
