from datetime import date, timedelta

from django.utils import timezone
from rest_framework import serializers

from metering.request_log import STATUSES
from metering.selectors import GROUPS
from quilt.query import DayField, QueryInput, is_day

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


class DayOrInstantField(serializers.DateTimeField):
    """YYYY-MM-DD (a date: metering.request_log_csv.until_instant and since_instant read it as a whole day) or an
    ISO 8601 instant (a timezone-aware datetime)."""

    def to_internal_value(self, value):
        if is_day(value):
            return DayField().to_internal_value(value)
        return super().to_internal_value(value)


class RequestLogQueryInput(QueryInput):
    key = serializers.CharField(required=False, default="", max_length=16, help_text="An API key's prefix.")
    adapter = serializers.CharField(required=False, default="", max_length=200,
                                    help_text="An adapter's name; '-' for requests to a base model.")  # fmt: skip
    model = serializers.CharField(required=False, default="", max_length=200, help_text="A base model's name.")
    status = serializers.ChoiceField(required=False, default="", choices=["", *STATUSES],
                                     help_text="'refused': answered with an error before any engine generated.")
    since = DayOrInstantField(required=False, default=None,
                              help_text="Finished on or after: a UTC day (YYYY-MM-DD, from its start) or an instant.")
    until = DayOrInstantField(required=False, default=None,
                              help_text="A UTC day (YYYY-MM-DD) is included whole, as in the console and the usage API; "
                                        "an instant (ISO 8601 with a time) is exclusive.")
    sort = serializers.ChoiceField(
        required=False, default="-time",
        choices=[f"{sign}{name}" for name in ("time", "latency", "ttft", "cost", "tokens") for sign in ("-", "")],
        help_text="A column, newest/largest first with a leading '-'.",
    )  # fmt: skip
    cursor = serializers.CharField(required=False, default="", max_length=400,
                                   help_text="next_cursor of the previous page.")  # fmt: skip
    limit = serializers.IntegerField(required=False, default=50, min_value=1, max_value=200)


class RequestLogRowOutput(serializers.Serializer):
    request_id = serializers.CharField()
    finished_at = serializers.DateTimeField()
    api_key = serializers.CharField(source="api_key_prefix", help_text="The key's prefix; empty for none.")
    model = serializers.CharField(help_text="The model as the client named it.")
    base_model = serializers.CharField()
    adapter = serializers.CharField(source="adapter_version.adapter.name", default=None, allow_null=True)
    adapter_version = serializers.IntegerField(source="adapter_version.number", default=None, allow_null=True)
    status = serializers.ChoiceField(choices=list(STATUSES))
    status_code = serializers.IntegerField(allow_null=True, help_text="The HTTP status the gateway answered (null: "
                                           "its report has not arrived; the times are then the engine's).")
    finish_reason = serializers.CharField(help_text="The engine's (stop, length, abort, error), or 'refused'.")
    error_code = serializers.CharField(help_text="The error's code as the client got it (rate_limit_exceeded ...).")
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    image_count = serializers.IntegerField(help_text="Images in the prompt (the image itself is not kept here).")
    image_tokens = serializers.IntegerField(help_text="The prompt tokens the images took (part of prompt_tokens).")
    ttft_ms = serializers.FloatField(allow_null=True, help_text="Time to first token from the gateway's receipt.")
    e2e_ms = serializers.FloatField(allow_null=True, help_text="Latency, end to end, from the gateway's receipt.")
    engine_ttft_ms = serializers.FloatField(allow_null=True, help_text="The engine's own TTFT, from its receipt.")
    engine_e2e_ms = serializers.FloatField(allow_null=True, help_text="The engine's own latency.")
    queue_ms = serializers.FloatField(allow_null=True)
    cost = serializers.DecimalField(source="price", max_digits=24, decimal_places=12)
    error = serializers.CharField()


class RequestLogPageOutput(serializers.Serializer):
    data = RequestLogRowOutput(many=True)
    next_cursor = serializers.CharField(allow_null=True, help_text="Pass as ?cursor= for the next page; null: last.")
