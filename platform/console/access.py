"""Who may open which console page, and in which tenant.

Tenant pages live under /t/<slug>/. The slug is only a choice: the page opens when the user is a member of
that tenant (or staff), with at least the page's role; otherwise it answers 404 (no membership) or 403 (role
too low), as the management API does. The last tenant opened is kept in the session under `quilt_tenant`, so
the management API and the next visit to / use the same one.
"""

from dataclasses import dataclass
from functools import wraps
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, JsonResponse
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme

from billing.selectors import BILLING_ROLE
from quilt.api_errors import error_body
from tenancy.api_base import SESSION_TENANT
from tenancy.audit import Actor
from tenancy.authority import SAFE_METHODS, SCOPES_OF_ROLE, require_writable
from tenancy.models import Membership, Tenant
from tenancy.roles import role_at_least
from tenancy.selectors import membership_for

Role = Membership.Role


@dataclass(frozen=True)
class Seat:
    """The user's place in the tenant a page is about: the tenant, their membership and what it allows."""

    tenant: Tenant
    membership: Membership | None
    is_staff: bool

    @property
    def role(self) -> str:
        return self.membership.role if self.membership else Role.OWNER

    def allows(self, minimum: str) -> bool:
        return self.is_staff or (self.membership is not None and role_at_least(self.membership.role, minimum))

    @property
    def can_write_keys(self) -> bool:
        return self.allows(Role.DEVELOPER)

    @property
    def key_scopes(self) -> frozenset[str]:
        """The scopes this seat may put on a key (and so revoke or rotate): the role's, everything for staff."""
        return SCOPES_OF_ROLE[Role.OWNER if self.is_staff else self.role]

    @property
    def can_write_adapters(self) -> bool:
        return self.allows(Role.DEVELOPER)

    @property
    def can_manage_members(self) -> bool:
        return self.allows(Role.ADMIN)

    @property
    def can_see_audit(self) -> bool:
        return self.allows(Role.ADMIN)

    @property
    def can_see_billing(self) -> bool:
        return self.allows(BILLING_ROLE)  # billing.selectors enforces it for the pages and the API alike

    @property
    def is_owner(self) -> bool:
        return self.allows(Role.OWNER)


def client_ip(request) -> str | None:
    return request.META.get("REMOTE_ADDR") or None


def actor_of(request) -> Actor:
    return Actor(user=request.user, ip_address=client_ip(request))


def seat_for(*, user, slug: str) -> Seat:
    tenant = Tenant.objects.select_related("plan").filter(slug=slug).first()
    if tenant is None:
        raise Http404("No such tenant.")
    membership = membership_for(user=user, tenant=tenant)
    if membership is None and not user.is_staff:
        raise Http404("No such tenant.")
    return Seat(tenant=tenant, membership=membership, is_staff=user.is_staff)


SESSION_ENDED = "Your session has ended. Log in again, then upload."


def page_to_return_to(request) -> str | None:
    """Where logging in leads back to: the page itself for a GET; for a form sent after the session ended, the page
    the form was on (its action answers only POST), when that page is on this site."""
    if request.method in ("GET", "HEAD"):
        return request.get_full_path()
    referer = request.headers.get("referer", "")
    if referer and url_has_allowed_host_and_scheme(referer, allowed_hosts={request.get_host()},
                                                   require_https=request.is_secure()):  # fmt: skip
        parts = urlsplit(referer)
        return parts.path + (f"?{parts.query}" if parts.query else "")
    return None


def login_required(view):
    """Django's login_required, except that a form or upload sent after the session ended is not lost in a 405."""

    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if request.user.is_authenticated:
            return view(request, *args, **kwargs)
        if request.headers.get("x-requested-with") == "XMLHttpRequest":
            return JsonResponse({"errors": [SESSION_ENDED]}, status=401)
        back = page_to_return_to(request)
        if back is None:
            return redirect(settings.LOGIN_URL)
        return redirect_to_login(back)

    return wrapper


def tenant_page(minimum: str = Role.VIEWER, *, billing: bool = False):
    """Decorates a view taking `slug`: sets request.seat, or answers 404/403 (403 also for a form sent to a suspended
    or closed tenant, which is read-only: except a `billing` page's, whose service lets billing's changes through)."""

    def decorate(view):
        @login_required
        @wraps(view)
        def wrapper(request, slug: str, *args, **kwargs):
            seat = seat_for(user=request.user, slug=slug)
            if not seat.allows(minimum):
                raise PermissionDenied(f"This needs the {minimum} role or higher.")
            if request.method not in SAFE_METHODS and not billing:
                require_writable(tenant=seat.tenant)
            request.seat = seat
            if request.session.get(SESSION_TENANT) != slug:
                request.session[SESSION_TENANT] = slug
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


class CsvQueryError(Exception):
    """A CSV download's query that can't be answered: a 400 naming it."""


def csv_download(view):
    """A CSV download answers its errors as JSON in the API's error shape with the right status (400, 403, 404), not
    as the console's HTML page nor as a CSV file: what fetches it is a script or a spreadsheet import, which should
    see the status. Outermost, so that the tenant's 404/403 are caught too."""

    @wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except CsvQueryError as error:
            status, code, message = 400, "invalid_query", str(error)
        except Http404 as error:
            status, code, message = 404, "not_found", str(error) or "Not found."
        except PermissionDenied as error:
            status, code, message = 403, getattr(error, "code", "permission_denied"), str(error) or "Not allowed."
        return JsonResponse(error_body(message=message, status_code=status, code=code), status=status)

    return wrapper


def staff_page(view):
    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            raise PermissionDenied("Only platform staff can open this page.")
        request.seat = None
        return view(request, *args, **kwargs)

    return wrapper
