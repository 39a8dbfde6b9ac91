from datetime import date, timedelta

from django.utils import timezone
from rest_framework import serializers

from metering.selectors import GROUPS
from quilt.query import DayField, QueryInput

MAX_DAYS = 366


class UsageQueryInput(QueryInput):
    start = DayField(required=False, help_text="First UTC day, YYYY-MM-DD (default: the 1st of this month).")
    end = DayField(required=False, help_text="Last UTC day, included, YYYY-MM-DD (default: today).")
    group_by = serializers.ChoiceField(choices=list(GROUPS), default="day")

    def validate(self, attrs):
        today = timezone.now().date()
        attrs.setdefault("end", today)
        attrs.setdefault("start", attrs["end"].replace(day=1))
        if attrs["end"] >= date.max:
            raise serializers.ValidationError({"end": f"Must be before {date.max}."}, code="invalid_range")
        if attrs["start"] > attrs["end"]:
            raise serializers.ValidationError("start must not be after end.", code="invalid_range")
        if attrs["end"] - attrs["start"] > timedelta(days=MAX_DAYS):
            raise serializers.ValidationError(f"At most {MAX_DAYS} days at a time.", code="invalid_range")
        return attrs


class UsageRowOutput(serializers.Serializer):
    group = serializers.CharField(
        help_text="The day (YYYY-MM-DD), the model as requested, or the key's prefix."
    )
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    price = serializers.DecimalField(max_digits=24, decimal_places=6)


class UsageOutput(serializers.Serializer):
    start = serializers.DateField()
    end = serializers.DateField()
    group_by = serializers.CharField()
    data = UsageRowOutput(many=True)
    total = UsageRowOutput()
