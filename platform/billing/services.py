"""Billing actions a person takes from the console, audited. The invoice run itself is billing.invoices."""

from datetime import date

from django.db import transaction

from billing.invoices import invoices_issue_month
from billing.models import Invoice
from tenancy.audit import Actor, audit_record


def invoices_issue_by_staff(*, actor: Actor, month: date) -> list[Invoice]:
    """Issues `month`'s invoices now (what the monthly beat task does on the 1st); each one newly issued is
    audited. Invoices issued before are returned unchanged and not audited again."""
    with transaction.atomic():
        already = set(Invoice.objects.filter(month=month.replace(day=1), status=Invoice.Status.ISSUED)
                      .values_list("pk", flat=True))  # fmt: skip
        invoices = invoices_issue_month(month=month)
        fresh = [invoice for invoice in invoices if invoice.pk not in already]
        for invoice in fresh:
            audit_record(
                actor=actor, action="invoice.issue", target=invoice, tenant=invoice.tenant,
                after={"number": invoice.number, "month": f"{invoice.month:%Y-%m}", "total": str(invoice.total)},
            )  # fmt: skip
    return fresh
