"""Request-body input for the management API's writes: a field the operation does not take is refused by name
with a 400, never dropped (a 200 that ignored what the caller sent reads as done: `{"nmae": "x"}` changed nothing)."""

from rest_framework import serializers


class RejectUnknownFields:
    """Mixed into an input serializer (before Serializer or ModelSerializer)."""

    def to_internal_value(self, data):
        if hasattr(data, "keys"):
            unknown = sorted(set(data.keys()) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {name: f"Unknown field; this takes {', '.join(self.fields)}." for name in unknown},
                    code="unknown_field",
                )  # fmt: skip
        return super().to_internal_value(data)
