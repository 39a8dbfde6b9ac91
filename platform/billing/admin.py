from django.contrib import admin

from billing.models import BudgetAlert, Invoice, InvoiceLine


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["number", "tenant", "month", "status", "total", "issued_at"]
    list_filter = ["status", "month"]
    inlines = [InvoiceLineInline]

    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None or obj.status != Invoice.Status.ISSUED


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    list_display = ["tenant", "month", "kind", "threshold", "emailed_at", "webhook_sent_at", "webhook_error"]
    list_filter = ["kind", "threshold"]
