from django.contrib import admin
from rest_framework_api_key.admin import APIKeyModelAdmin

from apikeys.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(APIKeyModelAdmin):
    list_display = [*APIKeyModelAdmin.list_display, "tenant", "last_used_at"]
    list_filter = [*APIKeyModelAdmin.list_filter, "tenant"]
