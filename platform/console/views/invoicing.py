"""Staff: a month's invoicing at a glance, and issuing its invoices now instead of waiting for the 1st."""

from datetime import date

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect
from django.urls import reverse
from django.utils import timezone

from billing.invoices import month_bounds, previous_month
from billing.selectors import month_invoicing
from billing.services import invoices_issue_by_staff
from console.access import actor_of, staff_page
from console.forms import FIRST_DATE, LAST_DATE
from console.pages import render_page
from console.views.post_only import post_only


def _month(value: str | None) -> date:
    """YYYY-MM from the query or form; last month when missing, unreadable or beyond the dates filters take."""
    try:
        month = date.fromisoformat(f"{value}-01")
    except (TypeError, ValueError):
        month = None
    if month is None or not FIRST_DATE <= month <= LAST_DATE:
        return previous_month(timezone.now().date())
    return month


def _recent_months(count: int = 12) -> list[date]:
    months, month = [], timezone.now().date().replace(day=1)
    for _ in range(count):
        months.append(month)
        month = previous_month(month)
    return months


@staff_page
def invoicing(request):
    month = _month(request.GET.get("month"))
    state = month_invoicing(month=month)
    context = {
        "state": state,
        "month": month,
        "months": _recent_months(),
        "ended": month_bounds(month)[1] <= timezone.now(),
        "issued_total": sum(invoice.total for invoice in state.issued),
    }
    return render_page(request, "console/invoicing.html", context, section="invoicing")


@post_only
@staff_page
def invoicing_issue(request):
    month = _month(request.POST.get("month"))
    target = f"{reverse('console:invoicing')}?month={month:%Y-%m}"
    try:
        fresh = invoices_issue_by_staff(actor=actor_of(request), month=month)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
        return redirect(target)
    if fresh:
        messages.success(request, f"Issued {len(fresh)} invoice{'s' if len(fresh) != 1 else ''} for {month:%B %Y}.")
    else:
        messages.info(request, f"Nothing to issue for {month:%B %Y}: every invoice of that month is out already.")
    return redirect(target)
