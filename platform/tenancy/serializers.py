from django.core.validators import RegexValidator, slug_re
from django.db import models
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from quilt.body import RejectUnknownFields
from quilt.fields import DecimalString
from quilt.query import QueryInput
from tenancy.authority import NotAllowed
from tenancy.models import AuditLog, Invitation, Membership, Plan, Tenant
from tenancy.webhook_targets import WEBHOOK_URL, validate_webhook_url


class PlanOutput(serializers.ModelSerializer):
    class Meta:
        model = Plan
        fields = [
            "id", "slug", "name", "requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
            "monthly_token_budget", "monthly_spend_limit", "max_adapters", "adapter_warm_tier", "max_warm_adapters", "max_adapter_bytes", "max_file_storage_bytes", "default_max_tokens",
            "scheduling_weight", "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok",
            "max_concurrent_fine_tuning_jobs", "price_training_per_mtok",
        ]  # fmt: skip


class PlanInput(RejectUnknownFields, serializers.ModelSerializer):
    serializer_field_mapping = {**serializers.ModelSerializer.serializer_field_mapping, models.DecimalField: DecimalString}

    class Meta:
        model = Plan
        fields = [field for field in PlanOutput.Meta.fields if field != "id"]


class TenantOutput(serializers.ModelSerializer):
    plan = PlanOutput()
    webhook_secret_set = serializers.SerializerMethodField(help_text="Whether webhooks have a secret to sign with.")

    class Meta:
        model = Tenant
        fields = ["id", "slug", "name", "status", "plan", "billing_email", "webhook_url", "webhook_secret_set",
                  "created_at"]  # fmt: skip

    def get_webhook_secret_set(self, tenant: Tenant) -> bool:
        return bool(tenant.webhook_secret)


STAFF_TENANT_FIELDS = ("slug", "name", "status", "plan")  # TenantUpdateInput's: platform staff change them


@extend_schema_field({"type": "string", "pattern": WEBHOOK_URL, "maxLength": 200,
                      "description": "An http(s) URL on a public host name (lower case; no address, no local name)."})
class WebhookUrlField(serializers.CharField):
    def __init__(self, **kwargs):
        super().__init__(required=False, allow_blank=True, max_length=200, **kwargs)
        self.validators.append(validate_webhook_url)


class TenantSettingsInput(RejectUnknownFields, serializers.Serializer):
    """What a tenant's own admins change. A field they may not change is refused: 403 for staff's (here), 400 for one
    that does not exist (RejectUnknownFields)."""

    billing_email = serializers.EmailField(required=False, allow_blank=True)
    webhook_url = WebhookUrlField()

    def to_internal_value(self, data):
        if isinstance(data, dict):
            staff = [name for name in STAFF_TENANT_FIELDS if name in data]
            if staff:
                raise NotAllowed(f"Only platform staff change a tenant's {', '.join(staff)}; here: "
                                 f"{', '.join(self.fields)}.", code="staff_only")  # fmt: skip
        return super().to_internal_value(data)


WEBHOOK_SECRET = r"^[ -~]{32,64}$"  # printable ASCII


class WebhookSecretInput(RejectUnknownFields, serializers.Serializer):
    secret = serializers.CharField(
        required=False, default="", min_length=32, max_length=64, trim_whitespace=False,
        validators=[RegexValidator(WEBHOOK_SECRET, "A webhook secret is 32 to 64 printable ASCII characters.")],
        help_text="32 to 64 printable ASCII characters; left out: a new random secret.",
    )  # fmt: skip


class WebhookSecretOutput(serializers.Serializer):
    webhook_secret = serializers.CharField(help_text="Shown this once: sign-check webhooks with it.")


@extend_schema_field({"type": "string", "pattern": "^[-a-zA-Z0-9_]+$", "maxLength": 50,
                      "description": "A plan's slug (a slug no plan has: 422)."})
class PlanField(serializers.SlugRelatedField):
    """A plan by its slug (a string: `5` is not "5"); what can't be a slug is a 400 before the lookup (PostgreSQL refuses a NUL: a 500), a slug
    no plan has a 422 (does_not_exist: quilt.api_errors)."""

    default_error_messages = {"invalid": "Must be a plan's slug: letters, digits, '-' and '_', at most 50."}

    def __init__(self, **kwargs):
        super().__init__(slug_field="slug", queryset=Plan.objects.all(), **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str) or not slug_re.fullmatch(data) or len(data) > 50:
            self.fail("invalid")
        return super().to_internal_value(data)


class TenantCreateInput(RejectUnknownFields, serializers.Serializer):
    slug = serializers.SlugField(max_length=50)
    name = serializers.CharField(max_length=200)
    plan = PlanField()
    billing_email = serializers.EmailField(required=False, default="")


class TenantListQueryInput(QueryInput):
    """?search= (in slug or name) and ?status= filter the staff's tenant list; ?limit= and ?offset= page it."""

    paged = True
    search = serializers.CharField(required=False, max_length=200)
    status = serializers.ChoiceField(choices=Tenant.Status.choices, required=False)


class AuditLogQueryInput(QueryInput):
    paged = True
    action = serializers.CharField(required=False, max_length=64, help_text="Actions starting with this: api_key.")
    actor = serializers.CharField(required=False, max_length=150, help_text="Rows of the user with this username.")


class StaffAuditLogQueryInput(AuditLogQueryInput):
    tenant = serializers.SlugField(required=False, help_text="Rows of the tenant with this slug.")


class TenantUpdateInput(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False)
    plan = PlanField(required=False)
    status = serializers.ChoiceField(choices=Tenant.Status.choices, required=False)
    billing_email = serializers.EmailField(required=False, allow_blank=True)
    webhook_url = WebhookUrlField()


class MemberOutput(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")
    email = serializers.CharField(source="user.email")

    class Meta:
        model = Membership
        fields = ["id", "username", "email", "role", "created_at"]


class MemberCreateInput(RejectUnknownFields, serializers.Serializer):
    """Members join by invitation: the address gets a link, and membership starts when they accept it."""

    email = serializers.EmailField(max_length=254)
    role = serializers.ChoiceField(choices=Membership.Role.choices)


class InvitationOutput(serializers.ModelSerializer):
    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "created_at", "expires_at", "accepted_at", "revoked_at"]


class InvitationCreatedOutput(InvitationOutput):
    accept_url = serializers.SerializerMethodField(help_text="The link the invitee opens; also e-mailed to them.")

    class Meta(InvitationOutput.Meta):
        fields = [*InvitationOutput.Meta.fields, "accept_url"]

    def get_accept_url(self, obj) -> str:
        return self.context["link"]


class InvitationPublicOutput(serializers.Serializer):
    tenant = serializers.CharField(source="tenant.name")
    email = serializers.EmailField()
    role = serializers.CharField()
    expires_at = serializers.DateTimeField()


class InvitationAcceptInput(RejectUnknownFields, serializers.Serializer):
    """Logged in: empty. Otherwise a username and password for a new account with the invited address."""

    username = serializers.RegexField(r"^[\w.@+-]+\Z", max_length=150, required=False, default="")
    password = serializers.CharField(max_length=128, required=False, default="", trim_whitespace=False)


class MemberUpdateInput(RejectUnknownFields, serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices)


class AuditLogOutput(serializers.ModelSerializer):
    actor = serializers.SerializerMethodField()
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)

    class Meta:
        model = AuditLog
        fields = ["id", "created_at", "actor", "tenant", "action", "target_type", "target_id", "before", "after",
                  "ip_address"]  # fmt: skip

    def get_actor(self, row: AuditLog) -> str:
        if row.actor_user_id:
            return row.actor_user.username
        if row.actor_key_id:
            return f"key:{row.actor_key.prefix}" if row.actor_key else "key:(deleted)"
        return "system"


class TenantAuditLogOutput(AuditLogOutput):
    """As tenants see their own log: platform staff show as `quilt-staff`, without their address."""

    ip_address = serializers.SerializerMethodField()

    def get_actor(self, row: AuditLog) -> str:
        if row.actor_user_id and row.actor_user.is_staff:
            return "quilt-staff"
        return super().get_actor(row)

    def get_ip_address(self, row: AuditLog) -> str | None:
        return None if row.actor_user_id and row.actor_user.is_staff else row.ip_address
