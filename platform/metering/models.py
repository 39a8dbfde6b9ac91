from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models

from tenancy.models import Plan, Tenant

MONEY = {"max_digits": 24, "decimal_places": 12, "default": Decimal(0)}
RATE = {"max_digits": 12, "decimal_places": 6, "validators": [MinValueValidator(Decimal(0))]}


class ModelPrice(models.Model):
    """A plan's prices for one base model, overriding the plan's own prices (per million tokens)."""

    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="model_prices")
    base_model = models.CharField(max_length=200)
    price_input_per_mtok = models.DecimalField(**RATE)
    price_cached_input_per_mtok = models.DecimalField(**RATE)
    price_output_per_mtok = models.DecimalField(**RATE)

    class Meta:
        ordering = ["plan", "base_model"]
        constraints = [
            models.UniqueConstraint(fields=["plan", "base_model"], name="modelprice_plan_model_unique")
        ]

    def __str__(self) -> str:
        return f"{self.plan} / {self.base_model}"


REFUSED = "refused"  # the finish_reason of a request the gateway answered without an engine generating anything


class ServedManager(models.Manager):
    """The requests an engine served (billed, counted in usage, invoices and economics): refusals left out."""

    def get_queryset(self):
        return super().get_queryset().exclude(finish_reason=REFUSED)


class UsageEvent(models.Model):
    """One request the gateway answered, written exactly once per request id: a finished (or aborted) request as
    the engine reported it, or a refusal the gateway reported (finish_reason "refused": 400, 404, 429, 503 ... with
    its status and error code, no tokens, no price).

    `objects` holds the served requests only (so no count of usage, spend or invoices ever includes a refusal);
    `answered` holds every row, for the request log and its charts.

    Price is fixed at ingest from the rates stored alongside it; cost is gpu_ms at the engine pool's hourly price
    (null when the event named no engine the gateway knows). A disaggregated request ran on two engines: gpu_ms is
    the whole request's, prefill_gpu_ms the part on `prefill_engine`, each part costed at its engine's price.

    ttft_ms and e2e_ms are measured by the gateway from its receipt of the request (what the client saw, less the
    network); engine_ttft_ms and engine_e2e_ms are the engine's own, from its receipt. Until the gateway's report
    arrives (status_code still null), ttft_ms and e2e_ms hold the engine's figures.
    """

    request_id = models.CharField(max_length=100, unique=True)
    tenant = models.ForeignKey(  # null: a refusal before a key let the request in (gateway_reports), nothing else
        Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="usage_events"
    )
    api_key = models.ForeignKey(
        "apikeys.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_events"
    )
    api_key_prefix = models.CharField(max_length=16, blank=True)
    model = models.CharField(max_length=250, help_text="The model name as the client requested it.")
    base_model = models.CharField(max_length=200)
    adapter_version = models.ForeignKey(
        "registry.AdapterVersion",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="usage_events",
    )
    adapter_digest = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField()
    image_count = models.PositiveIntegerField(default=0, help_text="Images in the prompt (the image is never stored "
                                                                   "here; a retained body keeps it).")
    image_tokens = models.PositiveIntegerField(default=0, help_text="The prompt tokens its images took (part of "
                                                                    "prompt_tokens, billed as prompt tokens).")
    gpu_ms = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    queue_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    e2e_ms = models.FloatField(null=True, blank=True)
    engine_ttft_ms = models.FloatField(null=True, blank=True, help_text="The engine's TTFT, from its receipt.")
    engine_e2e_ms = models.FloatField(null=True, blank=True, help_text="The engine's latency, from its receipt.")
    finish_reason = models.CharField(max_length=32, blank=True)
    status_code = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="The HTTP status the gateway answered; null until its report arrives.")
    error_code = models.CharField(max_length=64, blank=True, help_text="The error's code, as the client got it.")
    error = models.CharField(max_length=500, blank=True, help_text="Why the request failed, where it did.")
    engine = models.CharField(max_length=100, blank=True)
    prefill_engine = models.CharField(max_length=100, blank=True, help_text="Disaggregated: the prefill hop's engine.")
    prefill_gpu_ms = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0),
                                         help_text="Disaggregated: the part of gpu_ms spent on prefill_engine.")
    price_input_per_mtok = models.DecimalField(**RATE)
    price_cached_input_per_mtok = models.DecimalField(**RATE)
    price_output_per_mtok = models.DecimalField(**RATE)
    price = models.DecimalField(**MONEY)
    gpu_price_per_hour = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    cost = models.DecimalField(max_digits=24, decimal_places=12, null=True, blank=True)
    finished_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    invoice = models.ForeignKey(
        "billing.Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="usage_events",
        help_text="The invoice that billed this request (each request is billed once, late ones on the next).",
    )  # fmt: skip

    answered = models.Manager()
    objects = ServedManager()

    class Meta:
        default_manager_name = "objects"
        ordering = ["-finished_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "finished_at"], name="usage_tenant_finished"),
            models.Index(fields=["created_at"], name="usage_created"),
            # The request log's pages: newest first per tenant (and per key), across tenants for staff.
            models.Index(fields=["tenant", "-finished_at", "-id"], name="usage_log_tenant"),
            models.Index(fields=["api_key_prefix", "-finished_at", "-id"], name="usage_log_key"),
            models.Index(fields=["-finished_at", "-id"], name="usage_log_all"),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageDaily(models.Model):
    """Sums of UsageEvent per tenant, UTC day, model, adapter version and key; recomputed whole per (tenant, day)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_days")
    day = models.DateField()
    model = models.CharField(max_length=250)
    base_model = models.CharField(max_length=200)
    adapter_version_id = models.BigIntegerField(null=True, blank=True)
    api_key_prefix = models.CharField(max_length=16, blank=True)
    requests = models.PositiveIntegerField()
    prompt_tokens = models.BigIntegerField()
    cached_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    gpu_ms = models.DecimalField(max_digits=20, decimal_places=3)
    price = models.DecimalField(**MONEY)
    cost = models.DecimalField(**MONEY)

    class Meta:
        ordering = ["tenant", "day", "model"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "day", "model", "base_model", "adapter_version_id", "api_key_prefix"],
                name="usagedaily_dimensions_unique",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.day} {self.model}"


class UsageMonth(models.Model):
    """Running month-to-date totals per tenant, added to in the same transaction as the events they count."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_months")
    month = models.DateField(help_text="The first day of the month (UTC).")
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    price = models.DecimalField(**MONEY)
    cost = models.DecimalField(**MONEY)
    uncosted_requests = models.BigIntegerField(
        default=0, help_text="Requests from an engine with no known price."
    )

    class Meta:
        ordering = ["-month", "tenant"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month"], name="usagemonth_tenant_month_unique")
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.month:%Y-%m}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RollupCursor(models.Model):
    """One row: the roll-up has seen every event created before `rolled_up_to` (less a safety overlap)."""

    rolled_up_to = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"rolled up to {self.rolled_up_to}"


class ParkedUsageBatch(models.Model):
    """A batch `metering.ingest_usage` failed on for good (not a transient error): kept, never lost, until an
    operator fixes the cause and replays it (`manage.py replay_usage`; ingest is idempotent, so replaying is safe)."""

    events = models.JSONField()
    error = models.TextField()
    task_id = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    replayed_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{len(self.events)} events parked at {self.created_at:%Y-%m-%d %H:%M}"


class RequestBody(models.Model):
    """A request's prompt and completion, kept only for tenants that opted in (Tenant.request_body_retention_days)
    and deleted when `expires_at` passes (metering.purge_request_bodies, run by beat)."""

    request_id = models.CharField(max_length=100, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="request_bodies")
    prompt = models.JSONField(help_text="The messages or prompt as the client sent them.")
    completion = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return self.request_id
