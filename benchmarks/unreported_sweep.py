"""The unreported-usage sweep's CPU time with many tenants, few of them active.

    python -m benchmarks.unreported_sweep [--tenants 10000] [--active 100] [--repeats 5]
                                          [--database quilt_bench_sweep] [--redis redis://127.0.0.1:6379/14]

Creates the database (dropped first), migrates it and seeds `--tenants` tenants with INSERT ... SELECT
generate_series. `--active` of them get a served request that the gateway settled provisionally, keeping its usage
(what the sweep bills if the engine's own event never comes). Then, for each admission backend (Redis, then the
database), it runs one sweep `--repeats` times, as the beat task does every 30 s, and the algorithm it replaces in
the same process: a walk over every tenant asking admission for its unreported usage. Nothing is old enough to bill,
so each run does the same work. It prints the median, least and most CPU seconds of this process (time.process_time)
and wall seconds of each, and the ratio of the medians; and, apart, the first sweep's look-up of its tenants (on
Redis, a walk over every tenant once, to mark the copies kept before tenants were marked). Nothing is asserted; the goal is one sweep <= 1 s
of CPU with 10,000 tenants of which 100 are active.
"""

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from benchmarks.bench_database import database_create, tenants_insert

REPO = Path(__file__).resolve().parents[1]


def prepare(database: str, tenants: int) -> None:
    database_create(database)
    tenants_insert(database, tenants)


def every_tenant_walk(grace: float) -> int:
    """The sweep this one replaces: every tenant, each asked for its unreported usage."""
    from gateway.admission import unreported_usage
    from tenancy.models import Tenant

    found = 0
    for tenant_id in Tenant.objects.values_list("pk", flat=True):
        found += len(unreported_usage(tenant_id=tenant_id, older_than_seconds=grace))
    return found


def timed(function, repeats: int) -> tuple[list[float], list[float]]:
    cpu, wall = [], []
    for _ in range(repeats):
        started_cpu, started_wall = time.process_time(), time.perf_counter()
        function()
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started_wall)
    return cpu, wall


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.4f} s  ({min(values):.4f}-{max(values):.4f})"


def measure(args: argparse.Namespace) -> None:
    os.environ["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{args.database}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.dev")
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    import django

    django.setup()
    import redis
    from asgiref.sync import async_to_sync
    from django.test import override_settings

    from gateway.admission import admission_settle, unreported_tenants
    from gateway.unreported import unreported_usage_bill
    from tenancy.models import Tenant

    grace = 3600.0  # nothing is billed: every run does the same work
    active = list(Tenant.objects.order_by("?").values_list("pk", flat=True)[: args.active])
    prefix = f"quilt-bench-sweep-{uuid.uuid4().hex[:8]}"
    print(f"{args.tenants:,} tenants, {len(active)} of them with a provisional settle that keeps its usage; "
          f"{args.repeats} runs each")  # fmt: skip
    for name, url in (("redis", args.redis), ("database", "")):
        with override_settings(REDIS_URL=url, QUILT_REDIS_KEY_PREFIX=prefix):
            for tenant_id in active:
                request_id = uuid.uuid4().hex
                async_to_sync(admission_settle)(tenant_id=tenant_id, request_id=request_id, tokens=5, spend_micros=1,
                                                final=False, usage=json.dumps({"request_id": request_id}))  # fmt: skip
            seed_cpu, seed_wall = timed(unreported_tenants, 1)  # Redis: the one walk of a first sweep, not timed below
            new_cpu, new_wall = timed(lambda: unreported_usage_bill(older_than_seconds=grace), args.repeats)
            old_cpu, old_wall = timed(lambda: every_tenant_walk(grace), args.repeats)
        print(f"\n{name} backend         CPU (median, least-most)          wall")
        print(f"  every tenant     {spread(old_cpu)}   {spread(old_wall)}")
        print(f"  active tenants   {spread(new_cpu)}   {spread(new_wall)}")
        print(f"  CPU ratio (every / active): {statistics.median(old_cpu) / statistics.median(new_cpu):.1f}x")
        if url:
            print(f"  first sweep's one walk marking the kept copies: {seed_cpu[0]:.4f} s CPU, {seed_wall[0]:.4f} s")
            client = redis.Redis.from_url(url)
            for key in client.scan_iter(match=f"{prefix}:*"):
                client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--active", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--database", default="quilt_bench_sweep")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    prepare(args.database, args.tenants)
    measure(args)


if __name__ == "__main__":
    main()
