"""A PostgreSQL database of the benchmarks' own, made afresh and migrated, and the tenants they seed it with."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def psql(database: str, sql: str) -> str:
    done = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", database, "-v", "ON_ERROR_STOP=1", "-tA", "-c", sql],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"psql failed: {done.stderr.strip()}")
    return done.stdout.strip()


def database_exists(database: str) -> bool:
    return psql("postgres", f"SELECT 1 FROM pg_database WHERE datname = '{database}'") == "1"


def database_create(database: str) -> None:
    """Drop `database` if it exists, create it and apply every migration."""
    if database_exists(database):
        psql("postgres", f"DROP DATABASE {database}")
    psql("postgres", f"CREATE DATABASE {database}")
    env = {**os.environ, "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)


def tenants_insert(database: str, count: int) -> None:
    """One plan, 'bench', and `count` active tenants on it, slugs tenant-1 .. tenant-<count>."""
    psql(database, f"""
        INSERT INTO tenancy_plan (slug, name, requests_per_minute, tokens_per_minute, max_concurrent_requests,
            max_adapters, max_adapter_bytes, default_max_tokens, scheduling_weight, price_input_per_mtok,
            price_cached_input_per_mtok, price_output_per_mtok, max_concurrent_fine_tuning_jobs,
            price_training_per_mtok, minimum_monthly_charge, max_file_storage_bytes, created_at, updated_at)
        VALUES ('bench', 'Bench', 60, 100000, 8, 10, 1000000, 512, 1, 0.5, 0.125, 1.5, 1, 0, 0, 1000000, now(), now());
        INSERT INTO tenancy_tenant (slug, name, status, plan_id, billing_email, webhook_url, webhook_secret,
            request_body_retention_days, created_at, updated_at)
        SELECT 'tenant-' || n, 'Tenant ' || n, 'active', (SELECT id FROM tenancy_plan WHERE slug = 'bench'), '', '',
            '', 0, now(), now() FROM generate_series(1, {count}) AS n;
    """)  # fmt: skip
