from datetime import timedelta

from django.utils import timezone
from rest_framework import serializers

from metering.selectors import GROUPS

MAX_DAYS = 366


class UsageQueryInput(serializers.Serializer):
    start = serializers.DateField(required=False, help_text="First UTC day (default: the 1st of this month).")
    end = serializers.DateField(required=False, help_text="Last UTC day, included (default: today).")
    group_by = serializers.ChoiceField(choices=list(GROUPS), default="day")

    def validate(self, attrs):
        today = timezone.now().date()
        attrs.setdefault("end", today)
        attrs.setdefault("start", attrs["end"].replace(day=1))
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
