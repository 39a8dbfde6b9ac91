"""Staff pages over every tenant: search and status, create, change plan, suspend and reactivate."""

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Q
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from billing.selectors import invoice_preview, tenant_margin
from console.access import actor_of, staff_page
from console.forms import TenantCreateForm, TenantPlanForm, TenantStatusForm
from console.listing import listing
from console.pages import render_page
from console.views.post_only import post_only
from gateway.selectors import admission_month_drift
from tenancy.models import Plan, Tenant
from tenancy.selectors import invitations_pending_of, members_of
from tenancy.services import tenant_create, tenant_update

SORTABLE = {
    "name": ("name", "slug"),
    "slug": ("slug",),
    "plan": ("plan__name", "slug"),
    "status": ("status", "slug"),
    "members": ("member_count", "slug"),
    "created": ("created_at", "id"),
}


def margins_this_month() -> dict:
    """Revenue, GPU cost and margin of every tenant with usage this month, by tenant id (one query)."""
    return {row.tenant.pk: row for row in tenant_margin(month=timezone.now().date())}


@staff_page
def tenants(request):
    rows = Tenant.objects.select_related("plan").annotate(member_count=Count("memberships"))
    search = request.GET.get("q", "").strip()
    if search:
        rows = rows.filter(Q(slug__icontains=search) | Q(name__icontains=search) | Q(billing_email__icontains=search))
    status = request.GET.get("status", "")
    if status in Tenant.Status.values:
        rows = rows.filter(status=status)
    page = listing(request, rows, sortable=SORTABLE, default_sort="name")
    margins = margins_this_month()
    for tenant in page.rows:
        tenant.margin = margins.get(tenant.pk)
    context = {"tenants": page, "q": search, "status": status, "statuses": Tenant.Status.choices}
    return render_page(request, "console/tenants/list.html", context, section="tenants")


@staff_page
def tenant_new(request):
    form = TenantCreateForm(request.POST or None, initial={"plan": Plan.objects.order_by("price_output_per_mtok").first()})
    if request.method == "POST" and form.is_valid():
        try:
            tenant = tenant_create(actor=actor_of(request), **form.cleaned_data)
        except ValidationError as error:
            form.add_error(None, error)
        else:
            messages.success(request, f"Created {tenant.name}. Add its first member below.")
            return redirect("console:tenant-detail", slug=tenant.slug)
    status = 400 if form.is_bound else 200
    return render_page(request, "console/tenants/new.html", {"form": form}, section="tenants", status=status)


@staff_page
def tenant_detail(request, slug: str):
    tenant = get_object_or_404(Tenant.objects.select_related("plan"), slug=slug)
    context = {
        "tenant": tenant,
        "plan_form": TenantPlanForm(initial={"plan": tenant.plan}),
        "members": members_of(tenant=tenant)[:10],
        "member_count": members_of(tenant=tenant).count(),
        "invitations": invitations_pending_of(tenant=tenant),
        "margin": margins_this_month().get(tenant.pk),
        "preview": invoice_preview(tenant=tenant, month=timezone.now().date()),
        "drift": admission_month_drift(tenant_id=tenant.pk),
    }
    return render_page(request, "console/tenants/detail.html", context, section="tenants")


def _update(request, tenant: Tenant, changes: dict, done: str):
    try:
        tenant_update(actor=actor_of(request), tenant=tenant, changes=changes)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, done)
    return redirect("console:tenant-detail", slug=tenant.slug)


@post_only
@staff_page
def tenant_plan(request, slug: str):
    tenant = get_object_or_404(Tenant, slug=slug)
    form = TenantPlanForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a plan.")
        return redirect("console:tenant-detail", slug=slug)
    plan = form.cleaned_data["plan"]
    return _update(request, tenant, {"plan": plan}, f"{tenant.name} is now on the {plan.name} plan.")


@post_only
@staff_page
def tenant_status(request, slug: str):
    tenant = get_object_or_404(Tenant, slug=slug)
    form = TenantStatusForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Unknown status.")
        return redirect("console:tenant-detail", slug=slug)
    status = form.cleaned_data["status"]
    done = {
        Tenant.Status.SUSPENDED: f"{tenant.name} is suspended: its keys stop working within a second.",
        Tenant.Status.ACTIVE: f"{tenant.name} is active again.",
        Tenant.Status.CLOSED: f"{tenant.name} is closed.",
    }[status]
    return _update(request, tenant, {"status": status}, done)
