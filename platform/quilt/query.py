"""Query-string input for the management API's reads: what a caller gets wrong is a 400 naming the parameter,
never a silent default. A parameter given blank (`?start=`) is an error, not "use the default", and so is a
parameter the API does not take (`?since=` for `?start=`), which would otherwise be ignored."""

import re

from rest_framework import serializers

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII)
ALWAYS_ALLOWED = frozenset({"format"})  # DRF's ?format= (json / csv)
PAGE_PARAMETERS = frozenset({"limit", "offset"})


def is_day(value) -> bool:
    """Whether `value` is a day written YYYY-MM-DD."""
    return isinstance(value, str) and bool(_DAY.fullmatch(value))


class DayField(serializers.DateField):
    """A day written YYYY-MM-DD, and only so (not 2026-1-5, 20261001 or other digits than 0-9)."""

    def to_internal_value(self, value):
        if not isinstance(value, str) or not _DAY.fullmatch(value):
            self.fail("invalid", format="YYYY-MM-DD")
        return super().to_internal_value(value)


class QueryInput(serializers.Serializer):
    """Validates `request.query_params`: unknown and blank parameters are refused by name. A list's filters are paged
    too: its ?limit= and ?offset= are the pagination's to check (quilt.pagination)."""

    paged = False

    def to_internal_value(self, data):
        allowed = set(self.fields) | ALWAYS_ALLOWED | (PAGE_PARAMETERS if self.paged else set())
        unknown = sorted(name for name in data if name not in allowed)
        if unknown:
            raise serializers.ValidationError(
                {name: f"Unknown parameter; this takes {', '.join(sorted(self.fields))}." for name in unknown},
                code="unknown_parameter",
            )
        blank = [name for name in self.fields if name in data and data.get(name) == ""]
        if blank:
            raise serializers.ValidationError({name: "May not be blank." for name in blank}, code="blank")
        return super().to_internal_value(data)
