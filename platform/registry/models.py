from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

from tenancy.models import Tenant, WarmTier

model_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    "Use letters, digits, '.', '_' and '-', starting with a letter or digit ('@' pins a version).",
    code="invalid_name",
)


class BaseModel(models.Model):
    """A base checkpoint the engines serve; `name` is what clients put in `model`."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        DISABLED = "disabled"

    name = models.CharField(max_length=100, unique=True, validators=[model_name_validator])
    checkpoint_dir = models.CharField(max_length=500)
    architecture = models.CharField(max_length=64)
    config = models.JSONField(help_text="The checkpoint's Hugging Face config.json.")
    max_context = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Adapter(models.Model):
    """A tenant's alias for one ready version of a LoRA adapter (the name clients use)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=64, validators=[model_name_validator])
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    description = models.CharField(max_length=500, blank=True)
    warm_tier = models.CharField(
        max_length=8, choices=WarmTier.choices, default=WarmTier.NONE, blank=True,
        help_text="Pinned always-warm in this tier on every engine; empty: as its tenant's plan says.",
    )
    current_version = models.ForeignKey(
        "AdapterVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["tenant", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=Q(deleted_at__isnull=True), name="adapter_live_name_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class AdapterVersion(models.Model):
    """One immutable upload of an adapter. Its canonical form lives in the store under its digest."""

    class Status(models.TextChoices):
        UPLOADED = "uploaded"
        VALIDATING = "validating"
        READY = "ready"
        FAILED = "failed"

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UPLOADED, db_index=True)
    failure_code = models.CharField(max_length=64, blank=True)
    failure_message = models.TextField(blank=True)
    upload_key = models.CharField(max_length=300, blank=True, help_text="Storage prefix of the raw upload.")
    upload_bytes = models.BigIntegerField(default=0)
    upload_sha256 = models.CharField(
        max_length=64, blank=True, db_index=True, help_text="Content digest of the upload as sent (its files)."
    )
    digest = models.CharField(max_length=64, blank=True, db_index=True)
    storage_key = models.CharField(max_length=300, blank=True, help_text="Storage prefix of the canonical form.")
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    num_bytes = models.BigIntegerField(null=True, blank=True)
    validation_attempts = models.PositiveIntegerField(default=0)
    validation_started_at = models.DateTimeField(null=True, blank=True)
    validated_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["adapter", "number"]
        constraints = [
            models.UniqueConstraint(fields=["adapter", "number"], name="adapter_version_number_unique")
        ]

    def __str__(self) -> str:
        return f"{self.adapter}@{self.number}"

    @property
    def is_ready(self) -> bool:
        return self.status == self.Status.READY


class AdapterPromotion(models.Model):
    """The alias's history: the live rows form a stack whose top is the current version; rollback pops it."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="promotions")
    version = models.ForeignKey(AdapterVersion, on_delete=models.CASCADE, related_name="promotions")
    promoted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    promoted_at = models.DateTimeField(auto_now_add=True)
    rolled_back_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["adapter", "-id"]
        indexes = [models.Index(fields=["adapter", "rolled_back_at"], name="promotion_adapter_live")]

    def __str__(self) -> str:
        return f"{self.version} promoted at {self.promoted_at:%Y-%m-%d %H:%M:%S}"
