from decimal import Decimal

from django.db import models

from tenancy.models import Tenant

AMOUNT = {"max_digits": 16, "decimal_places": 2}
EXACT = {"max_digits": 24, "decimal_places": 12}
RATE = {"max_digits": 12, "decimal_places": 6}


class InvoiceIsIssued(Exception):
    """An issued invoice and its lines never change."""


class InvoiceQuerySet(models.QuerySet):
    def update(self, **kwargs):
        if self.filter(status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Issued invoices can't be updated.")
        return super().update(**kwargs)

    def delete(self):
        if self.filter(status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Issued invoices can't be deleted.")
        return super().delete()


class Invoice(models.Model):
    """A tenant's month: exact lines, their exact subtotal, and the total rounded once (billing.invoices)."""

    class Status(models.TextChoices):
        DRAFT = "draft"
        ISSUED = "issued"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="invoices")
    month = models.DateField(help_text="The first day of the month billed (UTC).")
    number = models.CharField(max_length=32, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    currency = models.CharField(max_length=3, default="USD")
    subtotal = models.DecimalField(**EXACT, default=Decimal(0), help_text="The lines' exact sum, before rounding.")
    minimum_charge = models.DecimalField(
        **AMOUNT, default=Decimal(0), help_text="Added to reach the plan's monthly minimum charge."
    )
    total = models.DecimalField(
        **AMOUNT, default=Decimal(0), help_text="The subtotal rounded once to the cent (half up), plus the minimum charge."
    )
    issued_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = InvoiceQuerySet.as_manager()

    class Meta:
        ordering = ["-month", "tenant"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month"], name="invoice_tenant_month_unique")
        ]

    def __str__(self) -> str:
        return self.number

    def save(self, *args, **kwargs):
        if self.pk is not None and Invoice.objects.filter(pk=self.pk, status=self.Status.ISSUED).exists():
            raise InvoiceIsIssued(f"Invoice {self.number} is issued and can't change.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if Invoice.objects.filter(pk=self.pk, status=self.Status.ISSUED).exists():
            raise InvoiceIsIssued(f"Invoice {self.number} is issued and can't be deleted.")
        return super().delete(*args, **kwargs)

    @property
    def rounding(self) -> Decimal:
        """What rounding the subtotal to the cent added (negative: took off)."""
        return self.total - self.minimum_charge - self.subtotal


class InvoiceLineQuerySet(models.QuerySet):
    def update(self, **kwargs):
        if self.filter(invoice__status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Lines of issued invoices can't be updated.")
        return super().update(**kwargs)

    def delete(self):
        if self.filter(invoice__status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Lines of issued invoices can't be deleted.")
        return super().delete()


class InvoiceLine(models.Model):
    """The month's usage of one model (as requested) at one set of rates: tokens, unit prices, amount."""

    invoice = models.ForeignKey(Invoice, on_delete=models.PROTECT, related_name="lines")
    model = models.CharField(max_length=250)
    base_model = models.CharField(max_length=200)
    adapter_version_id = models.BigIntegerField(null=True, blank=True)
    requests = models.BigIntegerField()
    input_tokens = models.BigIntegerField(help_text="Prompt tokens not served from the prefix cache.")
    cached_input_tokens = models.BigIntegerField()
    output_tokens = models.BigIntegerField()
    price_input_per_mtok = models.DecimalField(**RATE)
    price_cached_input_per_mtok = models.DecimalField(**RATE)
    price_output_per_mtok = models.DecimalField(**RATE)
    amount = models.DecimalField(**EXACT, help_text="Exact (not rounded): the invoice rounds its total once.")

    objects = InvoiceLineQuerySet.as_manager()

    class Meta:
        ordering = ["invoice", "model", "id"]

    def __str__(self) -> str:
        return f"{self.invoice_id}: {self.model}"

    def save(self, *args, **kwargs):
        if Invoice.objects.filter(pk=self.invoice_id, status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Lines of issued invoices can't change.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if Invoice.objects.filter(pk=self.invoice_id, status=Invoice.Status.ISSUED).exists():
            raise InvoiceIsIssued("Lines of issued invoices can't be deleted.")
        return super().delete(*args, **kwargs)

    @property
    def prompt_tokens(self) -> int:
        """Every input token, cached ones included: what usage, its CSV and the console call input."""
        return self.input_tokens + self.cached_input_tokens


class BudgetAlert(models.Model):
    """A budget threshold reached in a month: created once, delivered by email and (optionally) webhook."""

    class Kind(models.TextChoices):
        TOKENS = "tokens"
        SPEND = "spend"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budget_alerts")
    month = models.DateField()
    kind = models.CharField(max_length=16, choices=Kind.choices)
    threshold = models.PositiveSmallIntegerField(help_text="Percent of the monthly limit.")
    used = models.DecimalField(max_digits=24, decimal_places=6)
    limit = models.DecimalField(max_digits=24, decimal_places=6)
    emailed_at = models.DateTimeField(null=True, blank=True)
    webhook_sent_at = models.DateTimeField(null=True, blank=True)
    webhook_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month", "threshold", "kind"], name="budgetalert_once")
        ]

    def __str__(self) -> str:
        return f"{self.tenant} {self.month:%Y-%m} {self.kind} {self.threshold}%"
