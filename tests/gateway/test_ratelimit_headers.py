"""The x-ratelimit-* headers tell a client the limit it will meet first: an admitted call reports, of each kind
(requests, tokens), the tenant's window or the API key's own, whichever has fewer left; a refusal reports the window
that refused it. So a key limited to 2 requests a minute under a plan of 1,000 reads 1 left after its first call,
not 999, and is not surprised by a refusal at its third."""

from decimal import Decimal

from gateway.admission.limits import UNLIMITED, Decision, Limits
from gateway.caller import Caller
from gateway.refusals import ratelimit_headers
from metering.pricing import Rates


def caller(limits: Limits) -> Caller:
    return Caller(key_id=1, tenant_id=1, tenant_slug="t", limits=limits, default_max_tokens=16, weight=1.0,
                  rates=Rates(Decimal(1), Decimal(1), Decimal(1)), model_rates={}, allowed_models=(),
                  expires_at=None)  # fmt: skip


def told(headers: dict[str, str]) -> dict[str, tuple[int, int]]:
    return {kind: (int(headers[f"x-ratelimit-limit-{kind}"]), int(headers[f"x-ratelimit-remaining-{kind}"]))
            for kind in ("requests", "tokens") if f"x-ratelimit-limit-{kind}" in headers}  # fmt: skip


def test_an_admitted_call_reports_the_keys_limit_where_it_has_fewer_left():
    limits = Limits(1_000, 100_000, 10, -1, -1, key_prefix="k", key_requests_per_minute=2, key_tokens_per_minute=500)
    admitted = Decision(True, "ok", 1, 60, 30_000, 1, 60)
    assert told(ratelimit_headers(caller(limits), admitted)) == {"requests": (2, 1), "tokens": (500, 440)}


def test_an_admitted_call_reports_the_tenants_limit_where_the_tenant_has_fewer_left():
    limits = Limits(10, 1_000, 10, -1, -1, key_prefix="k", key_requests_per_minute=50, key_tokens_per_minute=900)
    admitted = Decision(True, "ok", 9, 300, 30_000, 1, 60)  # other keys of the tenant used most of its window
    assert told(ratelimit_headers(caller(limits), admitted)) == {"requests": (10, 1), "tokens": (1_000, 700)}


def test_each_kind_is_decided_on_its_own():
    limits = Limits(1_000, 1_000, 10, -1, -1, key_prefix="k", key_requests_per_minute=3, key_tokens_per_minute=2_000)
    admitted = Decision(True, "ok", 1, 500, 30_000, 1, 500)
    assert told(ratelimit_headers(caller(limits), admitted)) == {"requests": (3, 2), "tokens": (1_000, 500)}


def test_a_kind_only_the_key_limits_is_reported():
    limits = Limits(UNLIMITED, UNLIMITED, 10, -1, -1, key_prefix="k", key_requests_per_minute=2)
    admitted = Decision(True, "ok", 40, 9_000, 30_000, 2, 80)
    assert told(ratelimit_headers(caller(limits), admitted)) == {"requests": (2, 0)}


def test_a_keyless_call_and_a_tenants_refusal_report_the_tenants_window():
    limits = Limits(1_000, 100_000, 10, -1, -1)
    assert told(ratelimit_headers(caller(limits), Decision(True, "ok", 4, 80, 30_000))) == {
        "requests": (1_000, 996), "tokens": (100_000, 99_920)}  # fmt: skip
    keyed = Limits(5, 100_000, 10, -1, -1, key_prefix="k", key_requests_per_minute=2)
    refused = Decision(False, "requests", 5, 80, 30_000)  # the script stops before the key's window
    assert told(ratelimit_headers(caller(keyed), refused)) == {"requests": (5, 0), "tokens": (100_000, 99_920)}
