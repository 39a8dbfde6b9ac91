"""Base classes for the management API. The tenant is resolved once, from the credential.

- An API key belongs to exactly one tenant; each method needs a scope (`admin` covers every management scope).
- A logged-in user acts in the tenant named by the `X-Quilt-Tenant` header, the console's session choice,
  or their only membership; each method needs a minimum role. Staff may act in any tenant.
A tenant the caller can't act in answers 404, as if it did not exist.
"""

from django.http import Http404
from rest_framework import exceptions, permissions
from rest_framework.views import APIView

from apikeys.models import ApiKey, Scope
from tenancy.audit import Actor
from tenancy.authority import SAFE_METHODS, actor_role, require_writable
from tenancy.models import Membership, Tenant
from tenancy.roles import role_at_least

TENANT_HEADER = "HTTP_X_QUILT_TENANT"
SESSION_TENANT = "quilt_tenant"


class HasCredential(permissions.BasePermission):
    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, ApiKey) or bool(request.user and request.user.is_authenticated)


class IsStaffUser(permissions.BasePermission):
    message = "Only platform staff can do this."

    def has_permission(self, request, view) -> bool:
        return not isinstance(request.auth, ApiKey) and bool(request.user and request.user.is_staff)


def client_ip(request) -> str | None:
    return request.META.get("REMOTE_ADDR") or None


def actor_for(request) -> Actor:
    key = request.auth if isinstance(request.auth, ApiKey) else None
    user = request.user if request.user and request.user.is_authenticated else None
    return Actor(user=user, key=key, ip_address=client_ip(request))


def resolve_tenant(request) -> tuple[Tenant, Membership | None]:
    if isinstance(request.auth, ApiKey):
        return request.auth.tenant, None
    user = request.user
    slug = request.META.get(TENANT_HEADER) or request.session.get(SESSION_TENANT)
    memberships = Membership.objects.select_related("tenant", "tenant__plan").filter(user=user)
    if slug:
        membership = memberships.filter(tenant__slug=slug).first()
        if membership is not None:
            return membership.tenant, membership
        if user.is_staff:
            tenant = Tenant.objects.select_related("plan").filter(slug=slug).first()
            if tenant is not None:
                return tenant, None
        raise Http404("No such tenant.")
    only = list(memberships[:2])
    if len(only) == 1:
        return only[0].tenant, only[0]
    raise exceptions.ValidationError(
        "You belong to several tenants (or none): name one with the X-Quilt-Tenant header.", code="tenant_required"
    )


class StaffAPIView(APIView):
    permission_classes = [HasCredential, IsStaffUser]

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        self.actor = actor_for(request)


class TenantAPIView(APIView):
    """Subclasses set, per HTTP method, the minimum role (session) and the scope (API key) it needs."""

    permission_classes = [HasCredential]
    required_roles: dict[str, str] = {}
    required_scopes: dict[str, str] = {}
    billing_methods: frozenset[str] = frozenset()  # writes that are billing's: allowed while the tenant is suspended

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        self.actor = actor_for(request)
        self.tenant, self.membership = resolve_tenant(request)
        self._check_access(request)
        if request.method.upper() not in SAFE_METHODS:
            require_writable(tenant=self.tenant, billing=request.method.upper() in self.billing_methods)

    def _check_access(self, request) -> None:
        method = request.method.upper()
        role = self.required_roles.get(method, Membership.Role.ADMIN)
        if isinstance(request.auth, ApiKey):
            scope = self.required_scopes.get(method, Scope.ADMIN)
            if scope and not (request.auth.has_scope(scope) or request.auth.has_scope(Scope.ADMIN)):
                raise exceptions.PermissionDenied(f"This API key lacks the '{scope}' scope.", code="insufficient_scope")
            real_role = actor_role(actor=self.actor, tenant=self.tenant)  # the key's, capped by its creator's
        elif request.user.is_staff:
            return
        else:
            real_role = self.membership.role if self.membership is not None else None
        if real_role is None or not role_at_least(real_role, role):
            raise exceptions.PermissionDenied(f"This needs the {role} role or higher.", code="insufficient_role")
