"""Billing of a tenant: its plan and prices, invoices with their lines, CSV of an invoice."""

import csv

from django.http import Http404, HttpResponse
from django.utils import timezone

from billing.invoices import month_bounds
from billing.selectors import invoice_preview, invoice_with_lines, invoices_of
from billing.serializers import INVOICE_CSV_HEADER, invoice_csv_rows
from console.access import actor_of, csv_download, tenant_page
from console.listing import listing
from console.pages import render_page
from metering.selectors import model_prices_of, month_request_counts, usage_totals_month

SORTABLE = {"month": ("month", "id"), "total": ("total", "month", "id"), "status": ("status", "-month", "-id")}


@tenant_page()
def billing(request):
    tenant = request.seat.tenant
    invoices = invoices_of(tenant=tenant, reader=actor_of(request))  # 403 unless the seat may read billing
    today = timezone.now().date()
    context = {
        "preview": invoice_preview(tenant=tenant, month=today),
        "issue_date": month_bounds(today)[1],
        "plan": tenant.plan,
        "model_prices": model_prices_of(plan=tenant.plan),
        "month_to_date": usage_totals_month(tenant=tenant, month=today),
        "counts": month_request_counts(tenant=tenant, month=today),
        "invoices": listing(request, invoices, sortable=SORTABLE, default_sort="-month"),
    }
    return render_page(request, "console/billing/index.html", context, section="billing")


def _invoice(request, invoice_id: int):
    invoice = invoice_with_lines(tenant=request.seat.tenant, invoice_id=invoice_id, reader=actor_of(request))
    if invoice is None:
        raise Http404("No such invoice.")
    return invoice


@tenant_page()
def invoice(request, invoice_id: int):
    invoice = _invoice(request, invoice_id)
    lines = list(invoice.lines.all())
    context = {"invoice": invoice, "lines": lines}
    return render_page(request, "console/billing/invoice.html", context, section="billing")


@csv_download
@tenant_page()
def invoice_csv(request, invoice_id: int):
    invoice = _invoice(request, invoice_id)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{invoice.number}.csv"'
    writer = csv.DictWriter(response, fieldnames=INVOICE_CSV_HEADER, lineterminator="\n")
    writer.writeheader()
    writer.writerows(invoice_csv_rows(invoice))
    return response
