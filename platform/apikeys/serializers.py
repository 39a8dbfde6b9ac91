from rest_framework import serializers

from apikeys.models import ApiKey, Scope
from quilt.body import RejectUnknownFields
from quilt.fields import DecimalString


class ApiKeyOutput(serializers.ModelSerializer):
    id = serializers.CharField(source="prefix", read_only=True, help_text="The key's public prefix.")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    replaced_by = serializers.SlugRelatedField(slug_field="prefix", read_only=True, allow_null=True)

    class Meta:
        model = ApiKey
        fields = ["id", "prefix", "name", "scopes", "allowed_models", "created", "created_by", "expiry_date",
                  "revoked", "revoked_at", "last_used_at", "replaced_by", "monthly_spend_limit", "requests_per_minute",
                  "tokens_per_minute"]  # fmt: skip


class ApiKeyCreatedOutput(ApiKeyOutput):
    key = serializers.SerializerMethodField(help_text="The secret, shown this once and never again.")

    class Meta(ApiKeyOutput.Meta):
        fields = [*ApiKeyOutput.Meta.fields, "key"]

    def get_key(self, obj) -> str:
        return self.context["plaintext"]


class ApiKeyCreateInput(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=50)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False)
    allowed_models = serializers.ListField(child=serializers.CharField(max_length=200), required=False, default=list)
    expiry_date = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiKeyRotateInput(RejectUnknownFields, serializers.Serializer):
    grace_seconds = serializers.IntegerField(min_value=0, max_value=30 * 86400, default=86400)


class ApiKeyLimitsInput(RejectUnknownFields, serializers.Serializer):
    monthly_spend_limit = DecimalString(
        max_digits=14, decimal_places=2, min_value=0, allow_null=True, default=None,
        help_text="The key's own monthly budget in dollars; null: none (the tenant's still applies).",
    )  # fmt: skip
    requests_per_minute = serializers.IntegerField(min_value=1, allow_null=True, default=None)
    tokens_per_minute = serializers.IntegerField(min_value=1, allow_null=True, default=None)
