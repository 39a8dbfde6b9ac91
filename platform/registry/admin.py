from django.contrib import admin

from registry.models import Adapter, AdapterPromotion, AdapterVersion, BaseModel


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "architecture", "max_context", "status", "checkpoint_dir"]
    list_filter = ["status", "architecture"]
    search_fields = ["name"]


class AdapterVersionInline(admin.TabularInline):
    model = AdapterVersion
    extra = 0
    fields = ["number", "status", "digest", "rank", "num_bytes", "failure_message", "created_at"]
    readonly_fields = fields
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "base_model", "current_version", "created_at", "deleted_at"]
    list_filter = ["base_model", "deleted_at"]
    search_fields = ["name", "tenant__slug"]
    raw_id_fields = ["tenant", "current_version", "created_by"]
    inlines = [AdapterVersionInline]


@admin.register(AdapterVersion)
class AdapterVersionAdmin(admin.ModelAdmin):
    """Versions are immutable: the admin shows them and never edits them."""

    list_display = ["adapter", "number", "status", "digest", "rank", "num_bytes", "validation_attempts", "created_at"]
    list_filter = ["status"]
    search_fields = ["adapter__name", "adapter__tenant__slug", "digest"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(AdapterPromotion)
class AdapterPromotionAdmin(admin.ModelAdmin):
    list_display = ["adapter", "version", "promoted_by", "promoted_at", "rolled_back_at"]
    raw_id_fields = ["adapter", "version", "promoted_by"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
