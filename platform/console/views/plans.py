"""Staff pages for plans: prices per million tokens and the limits each plan buys."""

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect

from console.access import actor_of, staff_page
from console.forms import PlanForm
from console.pages import render_page
from tenancy.models import Plan
from tenancy.services import plan_create, plan_update


@staff_page
def plans(request):
    rows = Plan.objects.annotate(tenant_count=Count("tenants")).order_by("price_output_per_mtok", "slug")
    return render_page(request, "console/plans/list.html", {"plans": rows}, section="plans")


@staff_page
def plan_new(request):
    form = PlanForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            plan = plan_create(actor=actor_of(request), **form.cleaned_data)
        except ValidationError as error:
            form.add_error(None, error)
        else:
            messages.success(request, f"Created the {plan.name} plan.")
            return redirect("console:plans")
    context = {"form": form, "plan": None}
    return render_page(request, "console/plans/edit.html", context, section="plans", status=400 if form.errors else 200)


@staff_page
def plan_edit(request, plan_slug: str):
    plan = get_object_or_404(Plan, slug=plan_slug)
    form = PlanForm(request.POST or None, instance=Plan.objects.get(pk=plan.pk))
    if request.method == "POST" and form.is_valid():
        try:
            plan = plan_update(actor=actor_of(request), plan=plan, changes=form.changes())
        except ValidationError as error:
            form.add_error(None, error)
        else:
            messages.success(request, f"Saved the {plan.name} plan. New prices apply to usage from now on.")
            return redirect("console:plans")
    context = {"form": form, "plan": plan, "tenant_count": plan.tenants.count()}
    return render_page(request, "console/plans/edit.html", context, section="plans", status=400 if form.errors else 200)
