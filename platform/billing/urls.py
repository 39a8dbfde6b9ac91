from django.urls import path

from billing import api

urlpatterns = [
    path("invoices", api.InvoiceListApi.as_view(), name="api-invoices"),
    path("invoices/<int:invoice_id>", api.InvoiceDetailApi.as_view(), name="api-invoice"),
    path(
        "invoices/<int:invoice_id>.csv",
        api.InvoiceDetailApi.as_view(),
        {"format": "csv"},
        name="api-invoice-csv",
    ),
    path("reports/margin", api.MarginReportApi.as_view(), name="api-margin"),
]
