"""The console's front door: where / leads, and the tenant switcher."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect

from tenancy.api_base import SESSION_TENANT
from tenancy.selectors import tenants_for_user


@login_required
def home(request):
    """The last tenant opened, else the user's first; staff with no tenant chosen land on the platform page."""
    slug = request.session.get(SESSION_TENANT)
    tenants = tenants_for_user(user=request.user)
    if slug and tenants.filter(slug=slug).exists():
        return redirect("console:tenant-overview", slug=slug)
    if request.user.is_staff:
        return redirect("console:platform")
    first = tenants.order_by("name").first()
    if first is None:
        return redirect("console:no-tenant")
    return redirect("console:tenant-overview", slug=first.slug)


@login_required
def switch(request):
    slug = request.GET.get("tenant", "")
    if not slug:
        return redirect("console:tenants" if request.user.is_staff else "console:overview")
    return redirect("console:tenant-overview", slug=slug)
