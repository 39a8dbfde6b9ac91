"""Live pages and per-key controls in a real browser (Debian's Chromium) against the ASGI server, a real Celery
worker and a real engine: a request made through the `openai` package shows on the overview and in the request
log within 5 s of finishing, without a reload, its prompt and completion kept because the tenant opted in; an admin sets a key's budget on the keys page, that key is refused
once over it while its sibling key still works."""

import time
from decimal import Decimal

import openai
import pytest

from apikeys.services import api_key_create
from gateway.services import engine_register
from tenancy.audit import Actor
from tenancy.models import Plan
from tests.conftest import stop_worker
from tests.console.builders import BASE_NAME
from tests.console.live import start_engine, start_live_worker
from tests.console.test_browser import log_in
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Test-side instrumentation: the page must stay the same document (no reload) while it learns the news.
SAME_DOCUMENT = "window.__sameDocument = true"


def _open(browser, server, path: str):
    page = log_in(browser, server, "olga")
    page.goto(server.url + path)
    page.wait_for_selector("body[data-live-connected=yes]")
    page.evaluate(SAME_DOCUMENT)
    return page


def test_a_request_shows_live_and_a_key_over_its_budget_is_refused_while_its_sibling_works(
    browser, live_server_asgi, media_dir, base_model, tiny_base_dir, settings, screenshots
):
    server = live_server_asgi
    plan = Plan.objects.create(slug="steep", name="Steep", price_input_per_mtok=Decimal("1000"),
                               price_cached_input_per_mtok=Decimal("1000"), price_output_per_mtok=Decimal("4000"))  # fmt: skip
    tenant = TenantFactory(slug="acme", name="Acme Corp", plan=plan, request_body_retention_days=7)
    MembershipFactory(tenant=tenant, user=UserFactory(username="olga"), role="owner")
    capped, capped_secret = api_key_create(actor=Actor.system(), tenant=tenant, name="capped", scopes=["inference"])
    _, sibling_secret = api_key_create(actor=Actor.system(), tenant=tenant, name="sibling", scopes=["inference"])

    overview = _open(browser, server, "/t/acme/")
    log = _open(browser, server, "/t/acme/requests/")
    assert overview.inner_text("[data-testid=requests]") == "0"
    worker = start_live_worker(media_dir)
    engine, _ = None, None
    try:
        engine, engine_url = start_engine(tiny_base_dir, media_dir, served_name=BASE_NAME,
                                          token=settings.QUILT_ENGINE_TOKEN)  # fmt: skip
        engine_register(actor=Actor.system(), name="cpu-0", url=engine_url)
        sibling = openai.OpenAI(base_url=server.url + "/v1", api_key=sibling_secret, max_retries=0, timeout=60)
        answer = sibling.completions.with_raw_response.create(model=BASE_NAME, prompt="w1 w2 w3", max_tokens=4)
        finished = time.time()
        request_id = answer.headers["x-request-id"]
        overview.wait_for_function("document.querySelector('[data-testid=requests]').innerText === '1'",
                                   timeout=30_000)  # fmt: skip
        shown_after = time.time() - finished
        log.wait_for_selector(f"tr[data-request='{request_id}']", timeout=30_000)
        logged_after = time.time() - finished
        assert overview.evaluate("window.__sameDocument") and log.evaluate("window.__sameDocument")
        assert overview.evaluate("document.body.dataset.liveRefreshedBy") == "socket"
        assert shown_after < 5.0 and logged_after < 5.0, (shown_after, logged_after)
        log.screenshot(path=str(screenshots / "60-request-log-live.png"), full_page=True)
        log.click(f"tr[data-request='{request_id}'] a.primary")
        assert "Time to first token" in log.content()
        # The tenant keeps bodies for 7 days: the gateway stored this one's prompt and completion.
        assert "w1 w2 w3" in log.inner_text("[data-testid=request-prompt]")
        assert log.inner_text("[data-testid=request-completion]") == answer.parse().choices[0].text

        # The owner gives the capped key a budget of three cents on the keys page: about one request's worth.
        keys = overview
        keys.goto(server.url + "/t/acme/keys/")
        row = keys.locator(f"tr[data-key='{capped.prefix}']")
        row.locator("[data-testid=edit-limits]").click()
        row.locator("input[name=monthly_spend_limit]").fill("0.03")
        row.locator("[data-testid=save-limits]").click()
        keys.wait_for_selector("text=Saved the budget and limits")
        assert "of $0.03 budget" in keys.inner_text(f"tr[data-key='{capped.prefix}']")

        client = openai.OpenAI(base_url=server.url + "/v1", api_key=capped_secret, max_retries=0, timeout=60)
        refusal = None
        for _ in range(5):
            try:
                client.completions.create(model=BASE_NAME, prompt="w1 w2 w3", max_tokens=4)
            except openai.RateLimitError as refused:
                refusal = refused
                if refused.code == "insufficient_quota":
                    break
            time.sleep(0.5)
        assert refusal is not None and refusal.code == "insufficient_quota", refusal
        assert "API key" in refusal.body["message"]
        again = sibling.completions.create(model=BASE_NAME, prompt="w1", max_tokens=2)
        assert again.usage.completion_tokens >= 1
        keys.reload()
        spend = keys.inner_text(f"tr[data-key='{capped.prefix}'] [data-testid=key-spend]")
        assert spend.startswith("$0.0") and "of $0.03 budget" in spend
        keys.screenshot(path=str(screenshots / "61-keys-budget.png"), full_page=True)
    finally:
        stop_worker(worker)
        if engine is not None:
            stop_worker(engine)
