"""Input forms of the console. They parse and validate input only; the writes are the services' job."""

from datetime import date, timedelta

from django import forms
from django.core.validators import MaxValueValidator, MinValueValidator
from django.utils import timezone

from apikeys.models import Scope
from quilt.query import is_day
from registry.selectors import adapters_of, base_models_active
from tenancy.models import Membership, Plan, Tenant

# Filters add a day or subtract a year from the dates they are given: the calendar's own ends would overflow.
FIRST_DATE, LAST_DATE = date(1970, 1, 1), date(9998, 12, 31)
DATE_RANGE_MESSAGE = f"Choose a date between {FIRST_DATE} and {LAST_DATE}."


class FilterDateField(forms.DateField):
    default_validators = [
        MinValueValidator(FIRST_DATE, message=DATE_RANGE_MESSAGE),
        MaxValueValidator(LAST_DATE, message=DATE_RANGE_MESSAGE),
    ]

    def __init__(self, **kwargs):
        super().__init__(required=False, **kwargs)


class DayOrInstantField(forms.DateTimeField):
    """What the API's `since` and `until` take, with its meaning (metering.request_log_csv): YYYY-MM-DD, a whole UTC
    day, or an ISO 8601 instant; so a query copied from the API to the console (or back) finds the same rows."""

    def __init__(self, **kwargs):
        super().__init__(required=False, **kwargs)

    def to_python(self, value):
        if is_day(value):
            return FilterDateField().clean(value)
        return super().to_python(value)


SCOPE_HELP = {
    Scope.INFERENCE: "Call the models (/v1/chat/completions, /v1/completions).",
    Scope.ADAPTERS_WRITE: "Upload, promote and delete adapters.",
    Scope.USAGE_READ: "Read usage and invoices.",
    Scope.ADMIN: "Everything above, plus members and keys.",
}
EXPIRY_CHOICES = [("", "Never"), ("30", "In 30 days"), ("90", "In 90 days"), ("365", "In a year")]
GRACE_CHOICES = [("0", "Stop the old key now"), ("3600", "1 hour"), ("86400", "24 hours"), ("604800", "7 days")]


class TenantCreateForm(forms.Form):
    name = forms.CharField(max_length=200)
    slug = forms.SlugField(max_length=50, help_text="Lowercase letters, digits and dashes; used in URLs.")
    plan = forms.ModelChoiceField(queryset=Plan.objects.all(), to_field_name="slug", empty_label=None)
    billing_email = forms.EmailField(required=False)

    def clean_slug(self):
        slug = self.cleaned_data["slug"]
        if Tenant.objects.filter(slug=slug).exists():
            raise forms.ValidationError("A tenant with this slug already exists.")
        return slug


class TenantPlanForm(forms.Form):
    plan = forms.ModelChoiceField(queryset=Plan.objects.all(), to_field_name="slug", empty_label=None)


class TenantStatusForm(forms.Form):
    status = forms.ChoiceField(choices=Tenant.Status.choices)


class MemberAddForm(forms.Form):
    username = forms.CharField(required=False, max_length=150, help_text="Staff only: an existing user, added at once.")
    email = forms.EmailField(required=False, help_text="The address to invite.")
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.DEVELOPER)

    def clean(self):
        data = super().clean()
        if not data.get("username") and not data.get("email"):
            raise forms.ValidationError("Give the email address to invite.")
        return data


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Membership.Role.choices)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=50, help_text="What uses it, e.g. “production backend”.")
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, widget=forms.CheckboxSelectMultiple, initial=[Scope.INFERENCE],
        error_messages={"invalid_choice": "Your role can not give a key the %(value)s scope."},
    )
    expiry = forms.ChoiceField(choices=EXPIRY_CHOICES, required=False)
    allowed_models = forms.CharField(
        required=False, max_length=1000, help_text="Comma-separated model names; empty allows every model."
    )

    def __init__(self, *args, taken_names=(), allowed_scopes=frozenset(Scope.values), **kwargs):
        super().__init__(*args, **kwargs)
        self.taken_names = {name.casefold() for name in taken_names}
        self.fields["scopes"].choices = [(value, label) for value, label in Scope.choices if value in allowed_scopes]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if name.casefold() in self.taken_names:
            raise forms.ValidationError(
                f"A key named “{name}” already exists. Give each key its own name, or rotate the existing one."
            )
        return name

    def clean_allowed_models(self) -> list[str]:
        return [name.strip() for name in self.cleaned_data["allowed_models"].split(",") if name.strip()]

    def expiry_date(self):
        days = self.cleaned_data.get("expiry")
        return timezone.now() + timedelta(days=int(days)) if days else None


class ApiKeyRotateForm(forms.Form):
    grace = forms.ChoiceField(choices=GRACE_CHOICES, initial="86400")

    def grace_period(self) -> timedelta:
        return timedelta(seconds=int(self.cleaned_data["grace"]))


class ApiKeyLimitsForm(forms.Form):
    """A key's own budget and rates; an empty field means the key has none of its own (the tenant's apply)."""

    monthly_spend_limit = forms.DecimalField(
        required=False, min_value=0, max_digits=14, decimal_places=2, label="Monthly budget ($)"
    )
    requests_per_minute = forms.IntegerField(required=False, min_value=1, label="Requests per minute")
    tokens_per_minute = forms.IntegerField(required=False, min_value=1, label="Tokens per minute")


class AuditFilterForm(forms.Form):
    actor = forms.CharField(required=False, max_length=150)
    action = forms.CharField(required=False, max_length=64)
    since = FilterDateField()
    until = FilterDateField()
    tenant = forms.CharField(required=False, max_length=50)


class PlanForm(forms.ModelForm):
    class Meta:
        model = Plan
        fields = [
            "name", "slug", "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok",
            "requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "monthly_token_budget",
            "monthly_spend_limit", "max_adapters", "max_adapter_bytes", "max_file_storage_bytes", "default_max_tokens",
            "scheduling_weight", "price_training_per_mtok", "max_concurrent_fine_tuning_jobs", "minimum_monthly_charge",
        ]  # fmt: skip
        labels = {
            "minimum_monthly_charge": "Minimum monthly charge",
            "price_input_per_mtok": "Input, per 1M tokens",
            "price_cached_input_per_mtok": "Cached input, per 1M tokens",
            "price_output_per_mtok": "Output, per 1M tokens",
            "requests_per_minute": "Requests per minute",
            "tokens_per_minute": "Tokens per minute",
            "max_concurrent_requests": "Concurrent requests",
            "monthly_token_budget": "Monthly token budget",
            "monthly_spend_limit": "Monthly spend limit",
            "max_adapters": "Adapters",
            "max_adapter_bytes": "Largest adapter (bytes)",
            "max_file_storage_bytes": "Fine-tuning file storage (bytes)",
            "default_max_tokens": "Default max_tokens",
            "scheduling_weight": "Scheduling weight",
            "price_training_per_mtok": "Training, per 1M tokens",
            "max_concurrent_fine_tuning_jobs": "Concurrent fine-tuning jobs",
        }

    PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_training_per_mtok")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in self.PRICES:  # a negative price would pay tenants for their tokens
            self.fields[name].validators.append(MinValueValidator(0))
            self.fields[name].widget.attrs["min"] = "0"

    def changes(self) -> dict:
        return {name: self.cleaned_data[name] for name in self.changed_data}


class AdapterUploadForm(forms.Form):
    """Either `adapter` (a new version of it) or `name` + `base_model` (a new adapter). Files come as `file`."""

    adapter = forms.ModelChoiceField(queryset=None, to_field_name="name", required=False)
    name = forms.CharField(max_length=64, required=False)
    base_model = forms.ModelChoiceField(queryset=None, to_field_name="name", required=False)
    description = forms.CharField(max_length=500, required=False)

    def __init__(self, *args, tenant: Tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["adapter"].queryset = adapters_of(tenant=tenant)
        self.fields["base_model"].queryset = base_models_active()
        if self.fields["base_model"].queryset.count() == 1 and not self.is_bound:
            self.initial.setdefault("base_model", self.fields["base_model"].queryset.first())

    def clean(self):
        data = super().clean()
        if data.get("adapter") is None:
            if not data.get("name"):
                self.add_error("name", "Name the new adapter, or choose an existing one to add a version to.")
            if data.get("base_model") is None:
                self.add_error("base_model", "Choose the base model the adapter was trained on.")
        return data


GROUP_CHOICES = [("day", "Day"), ("model", "Model or adapter"), ("key", "API key")]
MAX_RANGE_DAYS = 366


class UsageFilterForm(forms.Form):
    since = FilterDateField()
    until = FilterDateField()
    model = forms.CharField(required=False, max_length=250)
    key = forms.CharField(required=False, max_length=16)
    group = forms.ChoiceField(choices=GROUP_CHOICES, required=False)
    every = forms.ChoiceField(choices=[("day", "Daily"), ("hour", "Hourly")], required=False)

    def window(self, *, today) -> tuple:
        """(since, until), defaulting to the last 30 days and clipped to a year. A field that is not valid takes
        its default and leaves the others as given."""
        self.is_valid()
        data = self.cleaned_data
        until = data.get("until") or today
        since = data.get("since") or until - timedelta(days=29)
        if since > until:
            since, until = until, since
        return max(since, until - timedelta(days=MAX_RANGE_DAYS - 1)), until

    def value(self, name: str) -> str:
        self.is_valid()
        return self.cleaned_data.get(name) or ""
