from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from quilt.body import RejectUnknownFields
from registry.models import Adapter, AdapterVersion, BaseModel, model_name_validator
from registry.selectors import adapter_previous_version, adapter_versions


class BaseModelOutput(serializers.ModelSerializer):
    class Meta:
        model = BaseModel
        fields = ["name", "architecture", "max_context", "status", "created_at"]


class AdapterVersionOutput(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = AdapterVersion
        fields = [
            "number", "status", "failure_code", "failure_message", "digest", "rank", "alpha", "target_modules",
            "num_bytes", "upload_bytes", "created_by", "created_at", "validated_at",
        ]  # fmt: skip


class AdapterOutput(serializers.ModelSerializer):
    base_model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    current_version = serializers.IntegerField(source="current_version.number", allow_null=True, read_only=True)

    class Meta:
        model = Adapter
        fields = ["name", "base_model", "description", "warm_tier", "current_version", "created_at"]


class AdapterDetailOutput(AdapterOutput):
    previous_version = serializers.SerializerMethodField(help_text="Where a rollback would go.")
    versions = serializers.SerializerMethodField()

    class Meta(AdapterOutput.Meta):
        fields = [*AdapterOutput.Meta.fields, "previous_version", "versions"]

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_previous_version(self, adapter: Adapter) -> int | None:
        version = adapter_previous_version(adapter=adapter)
        return version.number if version is not None else None

    @extend_schema_field(AdapterVersionOutput(many=True))
    def get_versions(self, adapter: Adapter) -> list:
        return AdapterVersionOutput(adapter_versions(adapter=adapter).select_related("created_by"), many=True).data


class AdapterCreatedOutput(AdapterOutput):
    version = serializers.SerializerMethodField()

    class Meta(AdapterOutput.Meta):
        fields = [*AdapterOutput.Meta.fields, "version"]

    @extend_schema_field(AdapterVersionOutput)
    def get_version(self, adapter: Adapter) -> dict:
        return AdapterVersionOutput(adapter_versions(adapter=adapter).last()).data


@extend_schema_field({"type": "string", "format": "binary"})
class UploadField(serializers.FileField):
    """A file part of a multipart body (binary in the OpenAPI schema, not a URL)."""


class AdapterCreateInput(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=64, validators=[model_name_validator])
    base_model = serializers.CharField(max_length=100)
    description = serializers.CharField(max_length=500, required=False, default="", allow_blank=True)
    file = serializers.ListField(
        child=UploadField(allow_empty_file=True), allow_empty=False,
        help_text="A .zip / .tar.gz of the PEFT adapter folder, or adapter_config.json and "
        "adapter_model.safetensors as two 'file' parts.",
    )  # fmt: skip


class AdapterVersionCreateInput(RejectUnknownFields, serializers.Serializer):
    file = serializers.ListField(child=UploadField(allow_empty_file=True), allow_empty=False)


class AdapterPromoteInput(RejectUnknownFields, serializers.Serializer):
    version = serializers.IntegerField(min_value=1)


class AdapterWarmInput(RejectUnknownFields, serializers.Serializer):
    tier = serializers.ChoiceField(choices=["host", "gpu", ""], allow_blank=True,
                                   help_text='Pin it always-warm in "host" or "gpu" memory on every engine; "" unpins.')

