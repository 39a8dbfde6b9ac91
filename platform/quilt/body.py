"""Request-body input for the management API's writes: a field the operation does not take is refused by name
with a 400, never dropped (a 200 that ignored what the caller sent reads as done: `{"nmae": "x"}` changed nothing).
So is a JSON value of another type than the schema gives the field: DRF's fields coerce (`"name": 5` is "5",
`"rank": "5"` is 5), which the schema does not allow."""

from rest_framework import serializers

# The JSON type a field's schema gives it; a null is the field's allow_null's to judge.
JSON_TYPES = (
    (serializers.BooleanField, bool, "a boolean"),
    (serializers.IntegerField, int, "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.CharField, str, "a string"),
    (serializers.ListField, list, "a list"),
)


def json_type_error(field, value) -> str | None:
    """What `value` should have been for `field`, when it is of another JSON type (None when it is not)."""
    if value is None:
        return None
    for kind, types, name in JSON_TYPES:
        if isinstance(field, kind):
            wrong = not isinstance(value, types) or (kind is not serializers.BooleanField and isinstance(value, bool))
            if wrong:
                return f"Must be {name}."
            if kind is serializers.ListField:
                return next(filter(None, (json_type_error(field.child, item) for item in value)), None)
            return None
    return None


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
        if type(data) is dict:  # a JSON body (a multipart form's values are all strings)
            wrong = {name: json_type_error(self.fields[name], value) for name, value in data.items()}
            if any(wrong.values()):
                raise serializers.ValidationError({name: why for name, why in wrong.items() if why}, code="invalid")
        return super().to_internal_value(data)
