from rest_framework import serializers

from billing.models import Invoice, InvoiceLine
from quilt.query import QueryInput


class ExactAmount(serializers.DecimalField):
    """An exact amount with every decimal it has and at least two ("0.04", "0.00133"): lines add up to the subtotal."""

    def __init__(self, **kwargs):
        super().__init__(max_digits=24, decimal_places=12, **kwargs)

    def to_representation(self, value):
        whole, _, decimals = f"{value.normalize():f}".partition(".")
        return f"{whole}.{decimals.ljust(2, '0')}"


class InvoiceLineOutput(serializers.ModelSerializer):
    amount = ExactAmount(help_text="Exact, not rounded: the invoice rounds its subtotal once, to the cent.")

    class Meta:
        model = InvoiceLine
        fields = [
            "model", "base_model", "adapter_version_id", "requests", "input_tokens", "cached_input_tokens",
            "output_tokens", "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "amount",
        ]  # fmt: skip


class InvoiceOutput(serializers.ModelSerializer):
    month = serializers.DateField(format="%Y-%m")
    subtotal = ExactAmount(help_text="The lines' exact sum.")

    class Meta:
        model = Invoice
        fields = [
            "id", "number", "month", "status", "currency", "subtotal", "minimum_charge", "total", "issued_at",
            "created_at",
        ]  # fmt: skip


class InvoiceDetailOutput(InvoiceOutput):
    lines = InvoiceLineOutput(many=True)

    class Meta(InvoiceOutput.Meta):
        fields = [*InvoiceOutput.Meta.fields, "lines"]


INVOICE_CSV_HEADER = ["invoice", "month", *InvoiceLineOutput.Meta.fields]


def invoice_csv_rows(invoice: Invoice) -> list[dict]:
    """An invoice as CSV rows (the API's `?format=csv` and the console's download alike): one per line with its
    exact amount, then subtotal, rounding, minimum charge and total."""
    body = InvoiceDetailOutput(invoice).data
    rows = [{"invoice": body["number"], "month": body["month"], **line} for line in body["lines"]]
    rows += [
        {"invoice": body["number"], "month": body["month"], "model": label, "amount": amount}
        for label, amount in (
            ("subtotal", body["subtotal"]), ("rounding", ExactAmount().to_representation(invoice.rounding)),
            ("minimum_charge", body["minimum_charge"]), ("total", body["total"]),
        )
    ]  # fmt: skip
    return rows


class MarginQueryInput(QueryInput):
    month = serializers.RegexField(r"^(?!0000)[0-9]{4}-(0[1-9]|1[0-2])$", help_text="YYYY-MM (year 0001 or later)")


class TenantMarginOutput(serializers.Serializer):
    tenant = serializers.SlugField(source="tenant.slug")
    month = serializers.DateField(format="%Y-%m")
    requests = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    revenue = serializers.DecimalField(max_digits=24, decimal_places=6)
    gpu_cost = serializers.DecimalField(max_digits=24, decimal_places=6)
    margin = serializers.DecimalField(max_digits=24, decimal_places=6)
    margin_ratio = serializers.DecimalField(max_digits=8, decimal_places=4, allow_null=True)
    uncosted_requests = serializers.IntegerField(
        help_text="Requests whose engine had no GPU price: cost unknown."
    )


class MarginReportOutput(serializers.Serializer):
    month = serializers.CharField()
    tenants = TenantMarginOutput(many=True)
    revenue = serializers.DecimalField(max_digits=24, decimal_places=6)
    gpu_cost = serializers.DecimalField(max_digits=24, decimal_places=6)
    margin = serializers.DecimalField(max_digits=24, decimal_places=6)
