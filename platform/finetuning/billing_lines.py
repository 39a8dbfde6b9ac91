"""Training tokens on the monthly invoice: one line per succeeded job, at the training price of the tenant's plan
when the job was created. Each job records the invoice that bills it, so it is billed exactly once."""

from datetime import datetime
from decimal import Decimal

from django.db.models import Q

from billing.invoices import line_amount
from billing.models import Invoice, InvoiceLine
from finetuning.models import FineTuningJob


def training_lines(*, invoice: Invoice, until: datetime, claim: bool = True) -> list[InvoiceLine]:
    """Claims for `invoice` the tenant's succeeded jobs finished before `until` and not billed yet (called by
    billing.invoices inside the invoice's transaction); returns their lines, unsaved. With `claim=False` (the
    upcoming-invoice preview, `invoice` unsaved) it only reads the jobs not billed yet and changes nothing."""
    jobs = FineTuningJob.objects.select_related("base_model").filter(
        tenant_id=invoice.tenant_id, status=FineTuningJob.Status.SUCCEEDED, finished_at__lt=until,
        trained_tokens__gt=0,
    )  # fmt: skip
    if claim:
        jobs = jobs.select_for_update(of=("self",)).filter(Q(invoice__isnull=True) | Q(invoice=invoice))
    else:
        jobs = jobs.filter(invoice__isnull=True)
    jobs = list(jobs.order_by("id"))
    if claim:
        FineTuningJob.objects.filter(pk__in=[job.pk for job in jobs]).update(invoice=invoice)
    zero = Decimal(0)
    return [
        InvoiceLine(
            invoice=invoice, model=f"fine-tuning {job.public_id} ({job.fine_tuned_model})", base_model=job.base_model.name,
            adapter_version_id=job.adapter_version_id, requests=1, input_tokens=job.trained_tokens,
            cached_input_tokens=0, output_tokens=0, price_input_per_mtok=job.price_training_per_mtok,
            price_cached_input_per_mtok=zero, price_output_per_mtok=zero,
            amount=line_amount(input_tokens=job.trained_tokens, cached_input_tokens=0, output_tokens=0,
                               rates=(job.price_training_per_mtok, zero, zero)),
        )  # fmt: skip
        for job in jobs
    ]
