from django.contrib import admin

from tenancy.models import AuditLog, Membership, Plan, Tenant


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "requests_per_minute", "tokens_per_minute", "price_input_per_mtok",
                    "price_output_per_mtok"]  # fmt: skip


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "status", "plan", "created_at"]
    list_filter = ["status", "plan"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role"]
    list_filter = ["role"]
    raw_id_fields = ["user", "tenant"]


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = ["created_at", "action", "tenant", "actor_user", "target_type", "target_id"]
    list_filter = ["action"]
    search_fields = ["target_id", "action"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
