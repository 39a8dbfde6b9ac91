"""Usage ingest: each request's event is written exactly once, priced, counted into its month, and announced.

Exactly once rests on the unique request id: rows go in with INSERT ... ON CONFLICT DO NOTHING RETURNING, so the
month counters are added to for precisely the rows this call inserted, in the same transaction. A replayed or
concurrent duplicate batch inserts nothing and adds nothing.
"""

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from apikeys.models import ApiKey
from metering.events import BadEvent, UsageRecord, usage_record_parse
from metering.models import ModelPrice, RequestBody, UsageEvent, UsageMonth
from metering.pricing import engine_gpu_prices, gpu_cost, rates_for, request_price
from metering.signals import RecordedUsage, usage_recorded
from registry.models import AdapterVersion
from tenancy.models import Tenant

logger = logging.getLogger(__name__)

INSERT_CHUNK = 500


@dataclass(frozen=True)
class IngestResult:
    inserted: int
    duplicates: int
    rejected: int


def month_of(day: date) -> date:
    return day.replace(day=1)


def _tenants(records: list[UsageRecord]) -> dict[str, Tenant]:
    refs = {record.tenant_ref for record in records}
    ids = [int(ref) for ref in refs if ref.isdigit()]
    slugs = [ref for ref in refs if not ref.isdigit()]
    found = {}
    for tenant in Tenant.objects.select_related("plan").filter(Q(pk__in=ids) | Q(slug__in=slugs)):
        found[str(tenant.pk)] = tenant
        found[tenant.slug] = tenant
    return found


def _api_keys(records: list[UsageRecord]) -> dict[str, ApiKey]:
    refs = {record.api_key_ref for record in records if record.api_key_ref}
    if not refs:
        return {}
    found = {}
    for key in ApiKey.objects.filter(Q(pk__in=refs) | Q(prefix__in=refs)):
        found[key.pk] = key
        found[key.prefix] = key
    return found


def _adapter_versions(records: list[UsageRecord]) -> dict[tuple[int, int | str], tuple[int, str]]:
    """(tenant id, version id or digest) -> (version id, adapter name), for the versions the events name.

    An event without the gateway's metadata still names its adapter's digest: the tenant's latest version with
    that digest stands in.
    """
    ids = {record.adapter_version_id for record in records if record.adapter_version_id is not None}
    digests = {record.adapter_digest for record in records if record.adapter_digest}
    found = {}
    matching = AdapterVersion.objects.filter(Q(pk__in=ids) | Q(digest__in=digests)).order_by("number")
    for pk, tenant_id, digest, name in matching.values_list(
        "pk", "adapter__tenant_id", "digest", "adapter__name"
    ):
        found[(tenant_id, pk)] = (pk, name)
        found[(tenant_id, digest)] = (pk, name)
    return found


def _rows(records: list[UsageRecord]) -> tuple[list[UsageEvent], int]:
    tenants, keys = _tenants(records), _api_keys(records)
    plan_ids = {tenant.plan_id for tenant in tenants.values()}
    overrides = {
        (price.plan_id, price.base_model): price
        for price in ModelPrice.objects.filter(
            plan_id__in=plan_ids, base_model__in={r.base_model for r in records}
        )
    }
    gpu_prices = engine_gpu_prices(names={r.engine for r in records} | {r.prefill_engine for r in records})
    versions = _adapter_versions(records)
    rows, rejected = [], 0
    for record in records:
        tenant = tenants.get(record.tenant_ref)
        if tenant is None:
            logger.error(
                "usage event %s names an unknown tenant %r; dropped", record.request_id, record.tenant_ref
            )
            rejected += 1
            continue
        key = keys.get(record.api_key_ref)
        if key is not None and key.tenant_id != tenant.pk:
            logger.error("usage event %s: key %s is not tenant %s's; key dropped", record.request_id, key.prefix,
                         tenant.slug)  # fmt: skip
            key = None
        version_id, adapter_name = versions.get((tenant.pk, record.adapter_version_id or record.adapter_digest),
                                                (None, ""))  # fmt: skip
        if record.adapter_version_id is not None and version_id is None:
            logger.error("usage event %s: adapter version %s is not tenant %s's; version dropped", record.request_id,
                         record.adapter_version_id, tenant.slug)  # fmt: skip
        rates = rates_for(plan=tenant.plan, base_model=record.base_model, overrides=overrides)
        price = request_price(
            rates=rates, prompt_tokens=record.prompt_tokens, cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
        )  # fmt: skip
        gpu_price_per_hour, cost = gpu_prices.get(record.engine), None
        if gpu_price_per_hour is not None:
            cost = gpu_cost(gpu_ms=record.gpu_ms, gpu_price_per_hour=gpu_price_per_hour)
            if record.prefill_engine:
                cost += _prefill_cost(record, gpu_prices.get(record.prefill_engine))
        else:
            logger.warning(
                "usage event %s: no engine named %r, so no GPU cost", record.request_id, record.engine
            )
        rows.append(
            UsageEvent(
                request_id=record.request_id, tenant=tenant, api_key=key,
                api_key_prefix=key.prefix if key is not None else record.api_key_ref.partition(".")[0][:16],
                model=record.model or adapter_name or record.base_model, base_model=record.base_model,
                adapter_version_id=version_id, adapter_digest=record.adapter_digest, prompt_tokens=record.prompt_tokens,
                cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
                image_count=record.image_count, image_tokens=record.image_tokens,
                gpu_ms=record.gpu_ms + record.prefill_gpu_ms, prefill_engine=record.prefill_engine,
                prefill_gpu_ms=record.prefill_gpu_ms,
                queue_ms=record.queue_ms, ttft_ms=record.ttft_ms, e2e_ms=record.e2e_ms,
                engine_ttft_ms=record.ttft_ms, engine_e2e_ms=record.e2e_ms,
                finish_reason=record.finish_reason, error=record.error, engine=record.engine, price_input_per_mtok=rates.input,
                price_cached_input_per_mtok=rates.cached_input, price_output_per_mtok=rates.output, price=price,
                gpu_price_per_hour=gpu_price_per_hour, cost=cost, finished_at=record.finished_at,
            )
        )  # fmt: skip
    return rows, rejected


def _prefill_cost(record: UsageRecord, gpu_price_per_hour: Decimal | None) -> Decimal:
    """The prefill hop's GPU time at its own engine's price (disaggregated serving)."""
    if gpu_price_per_hour is None:
        logger.warning("usage event %s: no prefill engine named %r, so its %s GPU ms go uncosted", record.request_id,
                       record.prefill_engine, record.prefill_gpu_ms)  # fmt: skip
        return Decimal(0)
    return gpu_cost(gpu_ms=record.prefill_gpu_ms, gpu_price_per_hour=gpu_price_per_hour)


def _insert_new(rows: list[UsageEvent]) -> set[str]:
    """INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING request_id: the ids this statement wrote."""
    fields = [field for field in UsageEvent._meta.concrete_fields if not field.primary_key]
    quote = connection.ops.quote_name
    columns = ", ".join(quote(field.column) for field in fields)
    one_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    now = timezone.now()
    inserted: set[str] = set()
    with connection.cursor() as cursor:
        for start in range(0, len(rows), INSERT_CHUNK):
            chunk = rows[start : start + INSERT_CHUNK]
            params = []
            for row in chunk:
                row.created_at = now
                params += [
                    field.get_db_prep_save(getattr(row, field.attname), connection) for field in fields
                ]
            cursor.execute(
                f"INSERT INTO {quote(UsageEvent._meta.db_table)} ({columns}) VALUES "
                f"{', '.join([one_row] * len(chunk))} ON CONFLICT ({quote('request_id')}) DO NOTHING "
                f"RETURNING {quote('request_id')}",
                params,
            )
            inserted.update(request_id for (request_id,) in cursor.fetchall())
    return inserted


def _add_to_months(rows: list[UsageEvent]) -> set[tuple[int, date]]:
    sums: dict[tuple[int, date], dict] = defaultdict(
        lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                 "price": Decimal(0), "cost": Decimal(0), "uncosted_requests": 0}
    )  # fmt: skip
    for row in rows:
        total = sums[(row.tenant_id, month_of(row.finished_at.astimezone(UTC).date()))]
        total["requests"] += 1
        total["prompt_tokens"] += row.prompt_tokens
        total["cached_tokens"] += row.cached_tokens
        total["completion_tokens"] += row.completion_tokens
        total["price"] += row.price
        total["cost"] += row.cost or 0
        total["uncosted_requests"] += row.cost is None
    UsageMonth.objects.bulk_create(
        [UsageMonth(tenant_id=tenant_id, month=month) for tenant_id, month in sorted(sums)],
        ignore_conflicts=True,
    )
    for (tenant_id, month), total in sorted(sums.items()):
        UsageMonth.objects.filter(tenant_id=tenant_id, month=month).update(
            **{name: F(name) + value for name, value in total.items()}
        )
    return set(sums)


def _announce(rows: list[UsageEvent], inserted: set[str]) -> None:
    usages = [
        RecordedUsage(
            tenant_id=row.tenant_id, request_id=row.request_id, tokens=row.total_tokens, price=row.price,
            month=month_of(row.finished_at.astimezone(UTC).date()), new=row.request_id in inserted,
            budgeted=row.tenant.plan.monthly_token_budget is not None or row.tenant.plan.monthly_spend_limit is not None,
            api_key_prefix=row.api_key_prefix,
            api_key_lineage=(row.api_key.lineage or row.api_key.prefix) if row.api_key is not None else row.api_key_prefix,
        )
        for row in rows
    ]  # fmt: skip
    usage_recorded.send(sender=UsageEvent, usages=usages)


def usage_ingest(*, events: list[dict]) -> IngestResult:
    """Writes the batch's new events and counts them into their months; after commit, announces every valid
    event as recorded (`metering.signals.usage_recorded`: admission settles its hold, billing checks alerts).

    Malformed events and unknown tenants are logged and dropped (a poison event must not block its batch).
    Replays are announced too: settling is idempotent, and a retry after a failure between commit and settling
    must still release the hold.
    """
    if not isinstance(events, list):
        raise TypeError(f"metering.ingest_usage takes a list of events, got {type(events).__name__}")
    records, rejected, seen = [], 0, set()
    for event in events:
        try:
            record = usage_record_parse(event)
        except BadEvent as error:
            logger.error("usage event dropped: %s: %r", error, event)
            rejected += 1
            continue
        if record.request_id not in seen:
            seen.add(record.request_id)
            records.append(record)
    rows, unknown = _rows(sorted(records, key=lambda record: record.request_id))
    with transaction.atomic():
        inserted = _insert_new(rows)
        _add_to_months([row for row in rows if row.request_id in inserted])
    _announce(rows, inserted)
    return IngestResult(inserted=len(inserted), duplicates=len(rows) - len(inserted), rejected=rejected + unknown)


def request_body_store(*, tenant_id: int, request_id: str, prompt, completion: str, retention_days: int) -> None:
    """Keeps a request's prompt and completion for a tenant that opted in, until `retention_days` from now;
    a second store of the same request changes nothing."""
    if retention_days <= 0:
        return
    RequestBody.objects.bulk_create(
        [RequestBody(tenant_id=tenant_id, request_id=request_id, prompt=prompt, completion=completion,
                     expires_at=timezone.now() + timedelta(days=retention_days))],
        ignore_conflicts=True,
    )  # fmt: skip


def request_bodies_retention_apply(*, tenant_id: int, days: int) -> int:
    """A tenant's new retention, applied to the bodies kept already: 0 deletes them all at once; fewer days bring
    each one's expiry forward (and delete those already past it). Returns how many were deleted."""
    bodies = RequestBody.objects.filter(tenant_id=tenant_id)
    if days <= 0:
        return bodies.delete()[0]
    with transaction.atomic():
        bodies.filter(expires_at__gt=F("created_at") + timedelta(days=days)).update(
            expires_at=F("created_at") + timedelta(days=days))  # fmt: skip
        return bodies.filter(expires_at__lte=timezone.now()).delete()[0]


def request_bodies_purge(*, now: datetime | None = None) -> int:
    """Deletes every stored body past its retention; returns how many."""
    deleted, _ = RequestBody.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted
