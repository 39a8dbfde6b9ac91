"""Invoices of the caller's tenant (JSON or CSV) and the staff margin report."""

from datetime import date
from decimal import Decimal

from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from apikeys.models import Scope
from billing.selectors import BILLING_ROLE, invoice_with_lines, invoices_of, tenant_margin
from billing.serializers import (
    INVOICE_CSV_HEADER,
    InvoiceDetailOutput,
    InvoiceOutput,
    MarginQueryInput,
    MarginReportOutput,
    invoice_csv_rows,
)
from metering.renderers import CsvRenderer
from quilt.pagination import StrictLimitOffsetPagination
from tenancy.api_base import StaffAPIView, TenantAPIView


class _InvoicesApi(TenantAPIView):
    """Invoices: billing.selectors decides who reads them (admin and above); a key needs the admin scope."""

    required_roles = {"GET": BILLING_ROLE}
    required_scopes = {"GET": Scope.ADMIN}


class InvoiceListApi(_InvoicesApi):
    pagination_class = StrictLimitOffsetPagination  # strict ?limit=/?offset=, and the schema shows the page

    @extend_schema(responses=InvoiceOutput(many=True))
    def get(self, request):
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(invoices_of(tenant=self.tenant, reader=self.actor), request, view=self)
        return paginator.get_paginated_response(InvoiceOutput(page, many=True).data)


class InvoiceDetailApi(_InvoicesApi):
    renderer_classes = [JSONRenderer, CsvRenderer]
    csv_header = INVOICE_CSV_HEADER

    @extend_schema(
        responses={
            200: OpenApiResponse(InvoiceDetailOutput, description="JSON, or CSV lines with ?format=csv")
        }
    )
    def get(self, request, invoice_id: int, format=None):
        invoice = invoice_with_lines(tenant=self.tenant, invoice_id=invoice_id, reader=self.actor)
        if invoice is None:
            raise Http404("No such invoice.")
        if request.accepted_renderer.format != "csv":
            return Response(InvoiceDetailOutput(invoice).data)
        rows = invoice_csv_rows(invoice)
        disposition = f'attachment; filename="{invoice.number}.csv"'
        return Response(rows, headers={"Content-Disposition": disposition})


class MarginReportApi(StaffAPIView):
    @extend_schema(parameters=[MarginQueryInput], responses=MarginReportOutput)
    def get(self, request):
        query = MarginQueryInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        month = date.fromisoformat(query.validated_data["month"] + "-01")
        rows = tenant_margin(month=month)
        revenue = sum((row.revenue for row in rows), Decimal(0))
        gpu_cost = sum((row.gpu_cost for row in rows), Decimal(0))
        report = {"month": query.validated_data["month"], "tenants": rows, "revenue": revenue, "gpu_cost": gpu_cost,
                  "margin": revenue - gpu_cost}  # fmt: skip
        return Response(MarginReportOutput(report).data)
