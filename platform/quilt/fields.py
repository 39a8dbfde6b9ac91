"""Serializer fields the management API shares: what each takes is exactly what its schema says."""

import re

from rest_framework import serializers

_DECIMAL = re.compile(r"-?[0-9]*(?:\.[0-9]*)?", re.ASCII)


class DecimalString(serializers.DecimalField):
    """A decimal written as a string of ASCII digits ("0.20", "12."), as the schema's pattern says. DRF's own field
    also takes a JSON number (a float may not be the amount the caller meant), a blank string as null, white space
    around the digits, an exponent and other scripts' digits, none of which the schema allows."""

    default_error_messages = {"not_digits": 'Write the amount as a string of digits, e.g. "0.20".'}

    def validate_empty_values(self, data):
        if isinstance(data, str):
            return False, data  # "" is no amount, not null: null is written null
        return super().validate_empty_values(data)

    def to_internal_value(self, data):
        if not isinstance(data, str) or not _DECIMAL.fullmatch(data) or not any(c.isdigit() for c in data):
            self.fail("not_digits")
        if data.startswith("-") and self.min_value is not None and self.min_value >= 0:
            self.fail("min_value", min_value=self.min_value)
        return super().to_internal_value(data)
