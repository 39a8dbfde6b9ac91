import logging
from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from engine.contract import EngineState, state_read
from gateway.engine_url import engine_url_validate
from tenancy.models import Tenant

log = logging.getLogger(__name__)


def engine_up(*, now=None) -> Q:
    """The one rule for whether an engine is up, for routing and for every page: its last check or heartbeat found
    it healthy, and, for a self-registered engine, that heartbeat has not expired (HEARTBEAT_MISSES intervals): an
    engine killed without a word is down as soon as its heartbeats are overdue, though nothing wrote its row."""
    return Q(healthy=True) & (Q(self_registered=False) | Q(heartbeat_expires_at__gt=now or timezone.now()))


class EngineQuerySet(models.QuerySet):
    def up(self) -> "EngineQuerySet":
        return self.filter(engine_up())


class Engine(models.Model):
    """An engine process the gateway routes to. `state` is its last /v1/state answer, or its last heartbeat's state
    for an engine that registered itself (`self_registered`), as plain JSON (engine.contract.EngineState: read it
    with `reported_state`). A self-registered engine is routed to only while its heartbeats keep
    `heartbeat_expires_at` in the future (docs/fleet.md). `healthy` is the last check's or heartbeat's word only:
whether the engine is up now is `engine_up` / `is_up`, which routing and the console share."""

    name = models.SlugField(max_length=64, unique=True)
    url = models.CharField(max_length=200, validators=[engine_url_validate],
                           help_text="Base URL of the engine's internal API, e.g. http://10.0.0.5:8100 or "
                                     "http://engine_prefill:8100 (any host the resolver takes)")
    token = models.CharField(max_length=200, blank=True, help_text="Empty means QUILT_ENGINE_TOKEN.")
    pool = models.SlugField(max_length=64, default="default")

    class Role(models.TextChoices):  # disaggregated serving (docs/kv-tiers.md)
        PREFILL = "prefill"
        DECODE = "decode"
        BOTH = "both"

    role = models.CharField(max_length=8, choices=Role.choices, default=Role.BOTH,
                            help_text="What the engine says it is for: prefill, decode or both (the default).")
    gpu_price_per_hour = models.DecimalField(
        max_digits=10, decimal_places=4, default=Decimal(0), validators=[MinValueValidator(Decimal(0))]
    )
    enabled = models.BooleanField(default=True)
    healthy = models.BooleanField(default=False)
    last_checked_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    state = models.JSONField(default=dict, blank=True)
    self_registered = models.BooleanField(default=False)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    heartbeat_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = EngineQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def reported_state(self) -> EngineState | None:
        """`state` as the contract's struct; None when the engine never reported one, or when the stored one is not
        one this side reads (kept from an engine of another version: logged, and the engine is routed to no more
        until it reports again, as a check or a heartbeat refuses such a state)."""
        if not self.state:
            return None
        try:
            return state_read(self.state)
        except ValueError as error:
            log.warning("engine %s: its stored state is unreadable: %s", self.name, error)
            return None

    @property
    def is_up(self) -> bool:
        """`engine_up` for this row (its answer is the same as the query's)."""
        if not self.healthy:
            return False
        return not self.self_registered or (
            self.heartbeat_expires_at is not None and self.heartbeat_expires_at > timezone.now())


class EngineLife(models.Model):
    """One life of a self-registered engine: from the heartbeat with which it joined to its last one (a drain's, or
    simply the last before it was killed). An engine that leaves and rejoins under its name has several; the time
    between them is no uptime (fleet.economics)."""

    engine = models.ForeignKey(Engine, on_delete=models.CASCADE, related_name="lives")
    started_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()

    class Meta:
        ordering = ["engine", "started_at"]
        indexes = [models.Index(fields=["engine", "started_at"], name="engine_life_start")]

    def __str__(self) -> str:
        return f"{self.engine_id} from {self.started_at:%Y-%m-%d %H:%M:%S}"


class AdmissionState(models.Model):
    """A tenant's admission counters when admission runs in the database (no REDIS_URL): the current
    one-minute window and the month's settled usage. Locked for the length of each admission."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+")
    window_start = models.BigIntegerField(default=0)  # unix seconds, a multiple of 60
    window_requests = models.PositiveIntegerField(default=0)
    window_tokens = models.BigIntegerField(default=0)
    month = models.CharField(max_length=7, default="")  # "2026-11"
    month_tokens = models.BigIntegerField(default=0)
    month_spend_picos = models.BigIntegerField(default=0)  # the settled requests' prices, exact (1e-12)
    # Per API key with its own limits, by key id: {"start", "requests", "tokens"} of its window and
    # {"month", "spend"} (micro-units) of its settled usage; on this row so that the tenant's lock covers it.
    keys = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"admission of tenant {self.tenant_id}"


class BudgetHold(models.Model):
    """A request's hold on its tenant's budget (database admission). Kept after settling, so that
    settling twice is a no-op. Provisional: settled by the gateway without the engine's counts (`tokens` and
    `spend_micros` are then what it counted), until metering's final settle replaces it."""

    class Status(models.TextChoices):
        HELD = "held"
        PROVISIONAL = "provisional"
        SETTLED = "settled"
        EXPIRED = "expired"

    request_id = models.CharField(max_length=100, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    api_key_prefix = models.CharField(max_length=16, blank=True, help_text="The key whose own limits it also holds.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.HELD)
    tokens = models.BigIntegerField()
    spend_micros = models.BigIntegerField()  # held: the estimate's price, rounded up to a micro-unit
    spend_picos = models.BigIntegerField(default=0, help_text="Settled: the price counted in its month, exact.")
    key_spend_picos = models.BigIntegerField(default=0, help_text="Its key's share, exact (1e-12 of the currency).")
    window_start = models.BigIntegerField()
    expires_at = models.FloatField()  # unix seconds
    settled_at = models.FloatField(null=True, blank=True)  # unix seconds
    usage = models.TextField(
        null=True, blank=True,
        help_text="Provisional: the usage event the gateway relayed (JSON), billed if the engine's never arrives.",
    )  # fmt: skip
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "status"], name="hold_tenant_status"),
            models.Index(  # the unreported-usage sweep's tenants: a few rows, however many holds were ever settled
                fields=["tenant"], name="hold_unreported", condition=Q(status="provisional", usage__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"hold {self.request_id} ({self.status})"


class EnginePin(models.Model):
    """An adapter the platform pins always-warm on an engine, and the engine's last answer: pinned, or refused (the
    tier's budget cannot hold it) or failed (the engine could not be reached or could not read it), with its words.
    One row per engine and digest; gone once the pin is no longer wanted (gateway.pins)."""

    class Status(models.TextChoices):
        PINNED = "pinned"
        REFUSED = "refused"
        FAILED = "failed"

    engine = models.ForeignKey(Engine, on_delete=models.CASCADE, related_name="pins")
    digest = models.CharField(max_length=64)
    tier = models.CharField(max_length=8)  # "host" or "gpu", as the engine API names them
    status = models.CharField(max_length=8, choices=Status.choices)
    message = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["engine", "digest"]
        constraints = [models.UniqueConstraint(fields=["engine", "digest"], name="engine_pin_unique")]

    def __str__(self) -> str:
        return f"{self.engine.name}/{self.digest[:12]} {self.tier} {self.status}"
