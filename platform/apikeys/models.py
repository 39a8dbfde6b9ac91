from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone
from rest_framework_api_key.models import AbstractAPIKey

from tenancy.models import Tenant


class Scope(models.TextChoices):
    INFERENCE = "inference"
    ADAPTERS_WRITE = "adapters:write"
    USAGE_READ = "usage:read"
    ADMIN = "admin"


class ApiKey(AbstractAPIKey):
    """A tenant's key. The plaintext is shown once at creation; only its prefix and a hash are stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    scopes = models.JSONField(default=list)
    allowed_models = models.JSONField(default=list, blank=True, help_text="Empty means every model.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    monthly_spend_limit = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(Decimal(0))],
        help_text="This key's own monthly budget, within the tenant's; empty means none.",
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="This key's own request rate, within the plan's; empty means none."
    )
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="This key's own token rate, within the plan's; empty means none."
    )
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    replaced_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # The key and its rotations: the first key's prefix, kept by every successor. Its monthly spend, budget and rate
    # windows are the lineage's, so a rotation never resets what the key has spent.
    lineage = models.CharField(max_length=16, blank=True, db_index=True)

    class Meta(AbstractAPIKey.Meta):
        abstract = False
        indexes = [models.Index(fields=["tenant", "-created"], name="apikey_tenant_created")]

    def save(self, *args, **kwargs) -> None:
        if not self.lineage:
            self.lineage = self.prefix
            if kwargs.get("update_fields") is not None:
                kwargs["update_fields"] = {*kwargs["update_fields"], "lineage"}
        super().save(*args, **kwargs)

    @property
    def is_usable(self) -> bool:
        return not self.revoked and (self.expiry_date is None or self.expiry_date > timezone.now())

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes
