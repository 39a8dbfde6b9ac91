"""The audit log, per tenant (admins) and across the platform (staff), filtered by actor, action and date."""

from datetime import datetime, time, timedelta

from django.utils import timezone

from console.access import Role, staff_page, tenant_page
from console.audit_text import describe_entries
from console.forms import AuditFilterForm
from console.listing import listing
from console.pages import render_page
from tenancy.models import Tenant
from tenancy.selectors import audit_log_list

SORTABLE = {"when": ("created_at", "id"), "action": ("action", "-id"), "actor": ("actor_user__username", "-id")}


def _filtered(request, *, tenant: Tenant | None):
    form = AuditFilterForm(request.GET)
    form.is_valid()
    data = {name: form.cleaned_data.get(name) for name in form.fields}
    unknown_tenant = False
    if tenant is None and data["tenant"]:
        tenant = Tenant.objects.filter(slug=data["tenant"]).first()
        unknown_tenant = tenant is None
    rows = audit_log_list(tenant=tenant, action=data["action"] or "", actor=data["actor"] or "")
    if unknown_tenant:
        rows = rows.none()
    zone = timezone.get_current_timezone()
    if data["since"]:
        rows = rows.filter(created_at__gte=datetime.combine(data["since"], time.min, tzinfo=zone))
    if data["until"]:
        rows = rows.filter(created_at__lt=datetime.combine(data["until"] + timedelta(days=1), time.min, tzinfo=zone))
    entries = listing(request, rows, sortable=SORTABLE, default_sort="-when", per_page=50)
    describe_entries(entries.rows)
    return form, entries


@tenant_page(Role.ADMIN)
def tenant_audit(request):
    form, entries = _filtered(request, tenant=request.seat.tenant)
    context = {"filters": form, "entries": entries, "platform": False}
    return render_page(request, "console/audit.html", context, section="audit")


@staff_page
def platform_audit(request):
    form, entries = _filtered(request, tenant=None)
    context = {"filters": form, "entries": entries, "platform": True}
    return render_page(request, "console/audit.html", context, section="platform-audit")
