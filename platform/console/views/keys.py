"""API keys of a tenant: list, create (secret shown once), revoke, rotate with a grace period.

A new secret is shown once after a redirect (post/redirect/get): the POST keeps it in the session, the next GET
takes it out and shows it, so reloading the page never creates a second key and never shows the secret again.
"""

from decimal import Decimal

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from apikeys.selectors import api_keys_of
from apikeys.services import api_key_create, api_key_limits_set, api_key_revoke, api_key_rotate
from console.access import Role, actor_of, tenant_page
from console.forms import SCOPE_HELP, ApiKeyCreateForm, ApiKeyLimitsForm, ApiKeyRotateForm
from console.listing import listing
from console.pages import render_page
from console.views.post_only import post_only
from metering.selectors import keys_spend_month
from tenancy.authority import NotAllowed

SORTABLE = {
    "name": ("name", "-id"),
    "created": ("created", "id"),
    "last_used": ("last_used_at", "id"),
    "expires": ("expiry_date", "id"),
}


def key_state(key, now) -> str:
    if key.revoked:
        return "revoked"
    if key.expiry_date is not None and key.expiry_date <= now:
        return "expired"
    if key.replaced_by_id is not None:
        return "rotated"
    return "active"


REVEAL_SESSION_KEY = "console.new_key"


def _reveal_later(request, *, key, plaintext: str, old=None):
    """Keeps the secret for exactly one GET of the keys page, then redirects there."""
    request.session[REVEAL_SESSION_KEY] = {
        "tenant": request.seat.tenant.pk, "key": key.pk, "plaintext": plaintext, "old": old.pk if old else None,
    }  # fmt: skip
    return redirect("console:keys", slug=request.seat.tenant.slug)


def _take_reveal(request) -> dict | None:
    stored = request.session.pop(REVEAL_SESSION_KEY, None)
    if not stored or stored["tenant"] != request.seat.tenant.pk:
        return None
    keys = api_keys_of(tenant=request.seat.tenant)
    key = keys.filter(pk=stored["key"]).first()
    if key is None:
        return None
    old = keys.filter(pk=stored["old"]).first() if stored["old"] else None
    return {"key": key, "plaintext": stored["plaintext"], "rotated": old is not None, "old": old}


def _page(request, *, form=None, created=None, status=200):
    seat = request.seat
    rows = api_keys_of(tenant=seat.tenant)
    state = request.GET.get("state", "")
    if state == "active":
        now = timezone.now()
        rows = rows.filter(revoked=False).filter(Q(expiry_date__isnull=True) | Q(expiry_date__gt=now))
    elif state == "revoked":
        rows = rows.filter(revoked=True)
    keys = listing(request, rows, sortable=SORTABLE, default_sort="-created")
    now = timezone.now()
    spend = keys_spend_month(tenant=seat.tenant)
    for key in keys.rows:
        key.state = key_state(key, now)
        key.manageable = seat.can_write_keys and set(key.scopes) <= seat.key_scopes
        key.spend_this_month = spend.get(key.lineage or key.prefix, Decimal(0))  # the lineage's: rotation keeps it
        key.budget_used = (
            min(100, int(key.spend_this_month * 100 / key.monthly_spend_limit)) if key.monthly_spend_limit else None
        )
    context = {
        "keys": keys,
        "state": state,
        "form": form or ApiKeyCreateForm(allowed_scopes=seat.key_scopes),
        "scope_help": SCOPE_HELP,
        "rotate_form": ApiKeyRotateForm(),
        "can_set_limits": seat.allows(Role.ADMIN),
        "created": created,
    }
    response = render_page(request, "console/keys.html", context, section="keys", status=status)
    if created is not None:
        response["Cache-Control"] = "no-store"
    return response


@tenant_page(Role.VIEWER)
def keys(request):
    if request.method != "POST":
        return _page(request, created=_take_reveal(request))
    if not request.seat.can_write_keys:
        raise PermissionDenied("Creating keys needs the developer role or higher.")
    taken = api_keys_of(tenant=request.seat.tenant).filter(revoked=False).values_list("name", flat=True)
    form = ApiKeyCreateForm(request.POST, taken_names=taken, allowed_scopes=request.seat.key_scopes)
    if not form.is_valid():
        return _page(request, form=form, status=400)
    try:
        key, plaintext = api_key_create(
            actor=actor_of(request), tenant=request.seat.tenant, name=form.cleaned_data["name"],
            scopes=form.cleaned_data["scopes"], allowed_models=form.cleaned_data["allowed_models"],
            expiry_date=form.expiry_date(),
        )  # fmt: skip
    except (ValidationError, NotAllowed) as error:
        form.add_error(None, error.message if isinstance(error, NotAllowed) else error)
        return _page(request, form=form, status=400)
    return _reveal_later(request, key=key, plaintext=plaintext)


def _key(request, prefix: str):
    return get_object_or_404(api_keys_of(tenant=request.seat.tenant), prefix=prefix)


@post_only
@tenant_page(Role.DEVELOPER)
def key_revoke(request, prefix: str):
    key = _key(request, prefix)
    try:
        api_key_revoke(actor=actor_of(request), key=key)
    except NotAllowed as refusal:
        messages.error(request, refusal.message)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"The key “{key.name}” ({key.prefix}) is revoked: it stops working within a second.")
    return redirect("console:keys", slug=request.seat.tenant.slug)


@post_only
@tenant_page(Role.DEVELOPER)
def key_rotate(request, prefix: str):
    key = _key(request, prefix)
    form = ApiKeyRotateForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose how long the old key keeps working.")
        return redirect("console:keys", slug=request.seat.tenant.slug)
    try:
        new, plaintext = api_key_rotate(actor=actor_of(request), key=key, grace=form.grace_period())
    except NotAllowed as refusal:
        messages.error(request, refusal.message)
        return redirect("console:keys", slug=request.seat.tenant.slug)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
        return redirect("console:keys", slug=request.seat.tenant.slug)
    return _reveal_later(request, key=new, plaintext=plaintext, old=key)


@post_only
@tenant_page(Role.ADMIN)
def key_limits(request, prefix: str):
    key = _key(request, prefix)
    form = ApiKeyLimitsForm(request.POST)
    if not form.is_valid():
        errors = [f"{form.fields[name].label}: {' '.join(messages_)}" for name, messages_ in form.errors.items()]
        messages.error(request, " ".join(errors))
        return redirect("console:keys", slug=request.seat.tenant.slug)
    try:
        api_key_limits_set(actor=actor_of(request), key=key, **form.cleaned_data)
    except NotAllowed as refusal:
        messages.error(request, refusal.message)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"Saved the budget and limits of “{key.name}”: they apply within a second.")
    return redirect("console:keys", slug=request.seat.tenant.slug)
