from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from tenancy.webhook_targets import validate_webhook_url

NOT_NEGATIVE = [MinValueValidator(Decimal(0))]


class WarmTier(models.TextChoices):
    """Where an adapter is pinned always-warm on every engine (docs/residency.md, "Pins"); NONE: not pinned."""

    NONE = "", "not pinned"
    HOST = "host", "host memory"
    GPU = "gpu", "device memory"


class Plan(models.Model):
    """Limits and prices a tenant buys. Prices are per million tokens, in the platform's currency."""

    slug = models.SlugField(max_length=50, unique=True)
    name = models.CharField(max_length=100)
    requests_per_minute = models.PositiveIntegerField(default=60)
    tokens_per_minute = models.PositiveIntegerField(default=100_000)
    max_concurrent_requests = models.PositiveIntegerField(default=8)
    monthly_token_budget = models.BigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(0)], help_text="Empty means unlimited."
    )
    monthly_spend_limit = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(Decimal(0))]
    )
    minimum_monthly_charge = models.DecimalField(
        max_digits=14, decimal_places=2, default=Decimal(0), validators=[MinValueValidator(Decimal(0))],
        help_text="An invoice with usage bills at least this much; 0 means no minimum.",
    )
    max_adapters = models.PositiveIntegerField(default=10)
    adapter_warm_tier = models.CharField(
        max_length=8, choices=WarmTier.choices, default=WarmTier.NONE, blank=True,
        help_text="Every adapter of the plan's tenants is pinned always-warm in this tier on every engine.",
    )
    max_warm_adapters = models.PositiveIntegerField(
        default=0, help_text="How many of its adapters a tenant may pin always-warm itself (the plan's tier aside).",
    )
    max_adapter_bytes = models.BigIntegerField(default=256 * 1024**2, validators=[MinValueValidator(1)])
    max_file_storage_bytes = models.BigIntegerField(
        default=1024**3, validators=[MinValueValidator(0)], help_text="All of a tenant's fine-tuning files together."
    )
    default_max_tokens = models.PositiveIntegerField(default=512)
    scheduling_weight = models.DecimalField(
        max_digits=6, decimal_places=2, default=Decimal("1.00"), validators=[MinValueValidator(Decimal("0.01"))]
    )
    price_input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0), validators=NOT_NEGATIVE)
    price_cached_input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0), validators=NOT_NEGATIVE)
    price_output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0), validators=NOT_NEGATIVE)
    max_concurrent_fine_tuning_jobs = models.PositiveIntegerField(default=1)
    price_training_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal(0), validators=NOT_NEGATIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["price_output_per_mtok", "slug"]

    def __str__(self) -> str:
        return self.name


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"
        CLOSED = "closed"

    slug = models.SlugField(max_length=50, unique=True)
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE, db_index=True)
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="tenants")
    billing_email = models.EmailField(blank=True)
    webhook_url = models.URLField(
        blank=True, validators=[validate_webhook_url], help_text="Budget alerts are POSTed here, signed with HMAC-SHA256."
    )
    webhook_secret = models.CharField(max_length=64, blank=True)
    request_body_retention_days = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(90)],
        help_text="Keep prompts and completions in the request log for this many days; 0 keeps metadata only.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner"
        ADMIN = "admin"
        DEVELOPER = "developer"
        VIEWER = "viewer"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.DEVELOPER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class AuditLog(models.Model):
    """One row per administrative action, written in the action's own transaction."""

    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_key = models.ForeignKey(
        "apikeys.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_constraint=False
    )
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_logs")
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=150)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    ip_address = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="audit_tenant_created")]

    def __str__(self) -> str:
        return f"{self.action} {self.target_type}:{self.target_id}"


class Invitation(models.Model):
    """An offer to join a tenant, sent to an e-mail address; membership starts when the invitee accepts it.
    Only a hash of the link's token is stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Membership.Role.choices)
    token_hash = models.CharField(max_length=64, unique=True)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="invitation_tenant_created")]

    def __str__(self) -> str:
        return f"{self.email} -> {self.tenant} ({self.role})"
