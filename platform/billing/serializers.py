from rest_framework import serializers

from billing.models import Invoice, InvoiceLine
from quilt.query import QueryInput


class InvoiceLineOutput(serializers.ModelSerializer):
    class Meta:
        model = InvoiceLine
        fields = [
            "model", "base_model", "adapter_version_id", "requests", "input_tokens", "cached_input_tokens",
            "output_tokens", "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "amount",
        ]  # fmt: skip


class InvoiceOutput(serializers.ModelSerializer):
    month = serializers.DateField(format="%Y-%m")

    class Meta:
        model = Invoice
        fields = ["id", "number", "month", "status", "currency", "total", "issued_at", "created_at"]


class InvoiceDetailOutput(InvoiceOutput):
    lines = InvoiceLineOutput(many=True)

    class Meta(InvoiceOutput.Meta):
        fields = [*InvoiceOutput.Meta.fields, "lines"]


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
