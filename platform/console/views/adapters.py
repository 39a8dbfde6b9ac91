"""Adapters of a tenant: list, upload (a new adapter or a new version), versions, promote, roll back, delete.

Uploads post through XHR so the page can show upload progress; such requests get JSON back ({redirect} or
{errors}), plain form posts get a redirect or the form again. Validation runs in the worker; the detail page
follows it live over the console websocket.
"""

from django.contrib import messages
from django.db.models import Count, OuterRef, Subquery
from django.http import Http404, JsonResponse
from django.shortcuts import redirect
from django.urls import reverse

from console.access import Role, actor_of, tenant_page
from console.forms import AdapterUploadForm
from console.listing import listing
from console.pages import render_page
from console.views.post_only import post_only
from registry.errors import RegistryRefusal
from registry.models import AdapterVersion
from registry.promotion import adapter_promote, adapter_rollback
from registry.selectors import (
    adapter_get,
    adapter_previous_version,
    adapter_versions,
    adapters_of,
    base_models_active,
)
from registry.services import adapter_create, adapter_delete, adapter_version_create, upload_limit

HISTORY = 12
PENDING = (AdapterVersion.Status.UPLOADED, AdapterVersion.Status.VALIDATING)
SORTABLE = {"name": ("name",), "created": ("created_at", "id"), "versions": ("version_count", "name")}


def _latest(field: str):
    newest = AdapterVersion.objects.filter(adapter=OuterRef("pk")).order_by("-number")
    return Subquery(newest.values(field)[:1])


@tenant_page(Role.VIEWER)
def adapters(request):
    rows = adapters_of(tenant=request.seat.tenant).annotate(
        version_count=Count("versions"), latest_number=_latest("number"), latest_status=_latest("status")
    )
    page = listing(request, rows, sortable=SORTABLE, default_sort="name")
    pending = any(adapter.latest_status in PENDING for adapter in page.rows)
    context = {"adapters": page, "base_models": base_models_active(), "pending": pending}
    return render_page(request, "console/adapters/list.html", context, section="adapters")


def _adapter(request, name: str):
    adapter = adapter_get(tenant=request.seat.tenant, name=name)
    if adapter is None:
        raise Http404("No such adapter.")
    return adapter


@tenant_page(Role.VIEWER)
def adapter_detail(request, name: str):
    adapter = _adapter(request, name)
    versions = list(adapter_versions(adapter=adapter).select_related("created_by").order_by("-number"))
    # Each query reads its own snapshot: reading the alias after its versions means a version seen ready (committed
    # with its automatic promotion) is never shown beside an alias that still looks empty.
    adapter = _adapter(request, name)
    context = {
        "adapter": adapter,
        "versions": versions,
        "previous": adapter_previous_version(adapter=adapter),
        "promotions": adapter.promotions.select_related("version", "promoted_by").order_by("-id")[:HISTORY],
        "pending": any(version.status in PENDING for version in versions),
    }
    return render_page(request, "console/adapters/detail.html", context, section="adapters")


def _refused(request, form, errors: list[str]):
    if request.headers.get("x-requested-with") == "XMLHttpRequest":
        return JsonResponse({"errors": errors}, status=400)
    for error in errors:
        form.add_error(None, error)
    return _upload_page(request, form, status=400)


def _upload_page(request, form, status=200):
    context = {"form": form, "limit": upload_limit(tenant=request.seat.tenant)}
    return render_page(request, "console/adapters/upload.html", context, section="adapters", status=status)


@tenant_page(Role.DEVELOPER)
def adapter_upload(request):
    tenant = request.seat.tenant
    form = AdapterUploadForm(request.POST or None, request.FILES or None, tenant=tenant,
                             initial={"adapter": request.GET.get("adapter", "")})  # fmt: skip
    if request.method != "POST":
        return _upload_page(request, form)
    if not form.is_valid():
        errors = [error for errors in form.errors.values() for error in errors]
        return _refused(request, form, errors)
    files = request.FILES.getlist("file")
    existing = form.cleaned_data["adapter"]
    try:
        if existing is not None:
            version = adapter_version_create(actor=actor_of(request), adapter=existing, files=files)
            adapter, number = existing, version.number
        else:
            adapter = adapter_create(
                actor=actor_of(request), tenant=tenant, name=form.cleaned_data["name"],
                base_model=form.cleaned_data["base_model"].name, files=files,
                description=form.cleaned_data["description"],
            )  # fmt: skip
            number = 1
    except RegistryRefusal as refusal:
        return _refused(request, form, [refusal.message])
    target = reverse("console:adapter", kwargs={"slug": tenant.slug, "name": adapter.name})
    messages.success(request, f"Uploaded version {number} of {adapter.name}. Validation has started.")
    if request.headers.get("x-requested-with") == "XMLHttpRequest":
        return JsonResponse({"redirect": target, "version": number})
    return redirect(target)


def _done(request, adapter):
    return redirect("console:adapter", slug=request.seat.tenant.slug, name=adapter.name)


@post_only
@tenant_page(Role.DEVELOPER)
def adapter_promote_view(request, name: str):
    adapter = _adapter(request, name)
    try:
        number = int(request.POST.get("version", ""))
    except ValueError:
        messages.error(request, "Choose a version to promote.")
        return _done(request, adapter)
    try:
        adapter_promote(actor=actor_of(request), adapter=adapter, version_number=number)
    except RegistryRefusal as refusal:
        messages.error(request, refusal.message)
    else:
        messages.success(request, f"{adapter.name} now serves version {number}. Running requests finish on the old one.")
    return _done(request, adapter)


@post_only
@tenant_page(Role.DEVELOPER)
def adapter_rollback_view(request, name: str):
    adapter = _adapter(request, name)
    try:
        adapter = adapter_rollback(actor=actor_of(request), adapter=adapter)
    except RegistryRefusal as refusal:
        messages.error(request, refusal.message)
    else:
        messages.success(request, f"Rolled {adapter.name} back to version {adapter.current_version.number}.")
    return _done(request, adapter)


@post_only
@tenant_page(Role.DEVELOPER)
def adapter_delete_view(request, name: str):
    adapter = _adapter(request, name)
    if request.POST.get("confirm_name") != adapter.name:
        messages.error(request, f"Type “{adapter.name}” to confirm the deletion.")
        return _done(request, adapter)
    try:
        adapter_delete(actor=actor_of(request), adapter=adapter)
    except RegistryRefusal as refusal:
        messages.error(request, refusal.message)
        return _done(request, adapter)
    messages.success(request, f"Deleted {adapter.name}. Requests naming it now fail with model_not_found.")
    return redirect("console:adapters", slug=request.seat.tenant.slug)
