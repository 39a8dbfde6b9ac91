"""The request log's page time with many requests in PostgreSQL.

    python -m benchmarks.request_log [--rows 10000000] [--database quilt_bench_log] [--repeats 40] [--keep]

Creates the database (dropped first unless --keep finds it already seeded with --rows), migrates it, and seeds
`--rows` usage events with INSERT ... SELECT generate_series, the log's indexes dropped during the load and built
after it (as a bulk load would): 1,000 tenants with 3 keys each, one big tenant holding a fifth of all rows, a
request every few hundred milliseconds spread over 90 days. Then it times the pages the console and the API ask
for, through the same selector (metering.request_log.request_log_page), each `--repeats` times:

  big tenant, newest page · the same 200 pages deep (by cursor) · filtered by key · filtered by status=error ·
  a day's window · staff view across tenants, newest page and 200 pages deep · sorted by latency within a day

and prints p50 and p95 in ms per case, and PostgreSQL's plan of the newest page (EXPLAIN ANALYZE) so one sees the
index it walks. Nothing is asserted; the goal is p95 <= 300 ms at 10 million rows.
"""

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from benchmarks.bench_database import database_create, database_exists, psql, tenants_insert

REPO = Path(__file__).resolve().parents[1]
LOG_INDEXES = ("usage_log_tenant", "usage_log_key", "usage_log_all", "usage_tenant_finished", "usage_created")
TENANTS = 1000


def prepare(database: str, rows: int, keep: bool) -> None:
    if keep and database_exists(database):
        seeded = psql(database, "SELECT count(*) FROM metering_usageevent")
        if int(seeded) == rows:
            print(f"{database}: already seeded with {rows:,} rows (--keep)")
            return
    database_create(database)
    started = time.monotonic()
    tenants_insert(database, TENANTS)
    for index in LOG_INDEXES:
        psql(database, f"DROP INDEX IF EXISTS {index}")
    first_tenant = int(psql(database, "SELECT min(id) FROM tenancy_tenant"))
    end = datetime(2026, 11, 24, tzinfo=UTC)
    span = timedelta(days=90).total_seconds()
    chunk = 1_000_000
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        # Row n: a fifth of all rows to the big tenant (the first), the rest spread; time runs backwards from `end`.
        psql(database, f"""
            INSERT INTO metering_usageevent (request_id, tenant_id, api_key_prefix, model, base_model,
                adapter_digest, prompt_tokens, cached_tokens, completion_tokens, gpu_ms, queue_ms, ttft_ms, e2e_ms,
                finish_reason, error, engine, price_input_per_mtok, price_cached_input_per_mtok,
                price_output_per_mtok, price, finished_at, created_at)
            SELECT 'bench-' || n,
                {first_tenant} + CASE WHEN n % 5 = 0 THEN 0 ELSE 1 + (n::bigint * 7919) % {TENANTS - 1} END,
                'k' || (CASE WHEN n % 5 = 0 THEN 0 ELSE 1 + (n::bigint * 7919) % {TENANTS - 1} END) || '-' || (n % 3),
                'tiny-llama', 'tiny-llama', '', 100 + n % 900, n % 100, 20 + n % 300, 50, 2, 10 + n % 90,
                100 + n % 2000, CASE WHEN n % 97 = 0 THEN 'error' ELSE 'stop' END, '', 'engine-1', 0.5, 0.125, 1.5,
                ((100 + n % 900) * 0.5 + (20 + n % 300) * 1.5) / 1000000,
                timestamptz '{end.isoformat()}' - (n * {span / rows!r}) * interval '1 second', now()
            FROM generate_series({start}, {stop - 1}) AS n
        """)  # fmt: skip
        print(f"  seeded {stop:,} / {rows:,} rows ({time.monotonic() - started:.0f} s)", flush=True)
    index_started = time.monotonic()
    psql(database, """
        CREATE INDEX usage_log_tenant ON metering_usageevent (tenant_id, finished_at DESC, id DESC);
        CREATE INDEX usage_log_key ON metering_usageevent (api_key_prefix, finished_at DESC, id DESC);
        CREATE INDEX usage_log_all ON metering_usageevent (finished_at DESC, id DESC);
        CREATE INDEX usage_tenant_finished ON metering_usageevent (tenant_id, finished_at);
        CREATE INDEX usage_created ON metering_usageevent (created_at);
    """)  # fmt: skip
    psql(database, "VACUUM ANALYZE metering_usageevent")
    print(f"{database}: {rows:,} rows in {index_started - started:.0f} s, indexes and ANALYZE in "
          f"{time.monotonic() - index_started:.0f} s")  # fmt: skip


def measure(database: str, repeats: int) -> None:
    os.environ["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.dev")
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    import django

    django.setup()
    from django.db import connection

    from metering.request_log import LogFilters, request_log_page
    from tenancy.models import Tenant

    big = Tenant.objects.order_by("id").first()
    newest = request_log_page(tenant=big, filters=LogFilters()).rows[0].finished_at
    day = LogFilters(since=newest - timedelta(days=1), until=newest + timedelta(seconds=1))

    def deep(tenant, filters, pages=200):
        cursor = ""
        for _ in range(pages):
            cursor = request_log_page(tenant=tenant, filters=filters, cursor=cursor).next_cursor
        return cursor

    deep_big, deep_all = deep(big, LogFilters()), deep(None, LogFilters())
    cases = {
        "big tenant, newest page": lambda: request_log_page(tenant=big, filters=LogFilters()),
        "big tenant, 200 pages deep": lambda: request_log_page(tenant=big, filters=LogFilters(), cursor=deep_big),
        "big tenant, one key": lambda: request_log_page(tenant=big, filters=LogFilters(key_prefix="k0-1")),
        "big tenant, status=error": lambda: request_log_page(tenant=big, filters=LogFilters(status="error")),
        "big tenant, last day": lambda: request_log_page(tenant=big, filters=day),
        "big tenant, last day by latency": lambda: request_log_page(tenant=big, filters=day, sort="-latency"),
        "small tenant, newest page": lambda: request_log_page(tenant=Tenant.objects.get(slug="tenant-500"),
                                                              filters=LogFilters()),  # fmt: skip
        "staff, newest page": lambda: request_log_page(tenant=None, filters=LogFilters()),
        "staff, 200 pages deep": lambda: request_log_page(tenant=None, filters=LogFilters(), cursor=deep_all),
    }
    rows = int(psql(database, "SELECT reltuples::bigint FROM pg_class WHERE relname = 'metering_usageevent'"))
    print(f"\n~{rows:,} rows; {repeats} runs per case, 50 rows a page; ms")
    print("| case | p50 | p95 | max |\n|---|---:|---:|---:|")
    for name, run in cases.items():
        run()  # warm
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            page = run()
            times.append((time.perf_counter() - started) * 1000)
            assert page.rows
        times.sort()
        p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
        print(f"| {name} | {statistics.median(times):.1f} | {p95:.1f} | {times[-1]:.1f} |", flush=True)
    queryset_sql = None
    with connection.execute_wrapper(lambda execute, sql, params, many, context: _keep(sql, params) or
                                    execute(sql, params, many, context)):  # fmt: skip
        request_log_page(tenant=big, filters=LogFilters())
    queryset_sql = _kept[-1]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + queryset_sql[0], queryset_sql[1])
        print("\nPlan of the big tenant's newest page:\n" + "\n".join(line for (line,) in cursor.fetchall()))


_kept: list = []


def _keep(sql, params) -> None:
    _kept.append((sql, params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--database", default="quilt_bench_log")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--keep", action="store_true", help="reuse the database if it holds --rows rows already")
    args = parser.parse_args()
    prepare(args.database, args.rows, args.keep)
    measure(args.database, args.repeats)


if __name__ == "__main__":
    main()
