from django.contrib import admin

from metering.models import ModelPrice, ParkedUsageBatch, UsageDaily, UsageEvent, UsageMonth


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = [
        "plan",
        "base_model",
        "price_input_per_mtok",
        "price_cached_input_per_mtok",
        "price_output_per_mtok",
    ]
    list_filter = ["plan"]


@admin.register(UsageEvent)
class UsageEventAdmin(admin.ModelAdmin):
    list_display = [
        "request_id",
        "tenant",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "price",
        "cost",
        "finished_at",
    ]
    list_filter = ["finish_reason", "engine"]
    search_fields = ["request_id", "tenant__slug", "model"]
    raw_id_fields = ["tenant", "api_key"]
    date_hierarchy = "finished_at"

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UsageDaily)
class UsageDailyAdmin(admin.ModelAdmin):
    list_display = ["tenant", "day", "model", "api_key_prefix", "requests", "price", "cost"]
    list_filter = ["day"]


@admin.register(UsageMonth)
class UsageMonthAdmin(admin.ModelAdmin):
    list_display = ["tenant", "month", "requests", "prompt_tokens", "completion_tokens", "price", "cost"]


@admin.register(ParkedUsageBatch)
class ParkedUsageBatchAdmin(admin.ModelAdmin):
    list_display = ["created_at", "task_id", "error", "replayed_at"]
    list_filter = ["replayed_at"]
