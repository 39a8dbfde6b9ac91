"""The console in a real browser (Debian's Chromium through Playwright) against the ASGI server, with a real
Celery worker validating uploads and ingesting usage, and live updates over the websocket."""

import httpx
import pytest

from apikeys.models import ApiKey
from apikeys.selectors import api_key_authenticate
from engine.contract import AdapterResidency
from gateway.services import engine_register
from registry.models import AdapterVersion
from tenancy.audit import Actor
from tenancy.models import AuditLog, Membership
from tests.conftest import stop_worker
from tests.console.builders import BASE_NAME
from tests.console.live import start_engine, start_live_worker
from tests.engine_states import adapters, engine_state_json
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-12345-secret"
LIVE_TIMEOUT_MS = 90_000

# Test-side instrumentation: the moment (browser clock, same machine as the server) version 1 shows as ready.
WATCH_READY = """() => {
  window.__readyAt = null;
  new MutationObserver(() => {
    if (!window.__readyAt && document.querySelector("tr[data-version='1'][data-status=ready]")) window.__readyAt = Date.now();
  }).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""

# Test-side instrumentation: remember every state of the upload progress bar across the page change that follows.
WATCH_PROGRESS = """() => {
  const box = document.querySelector('#upload-progress');
  sessionStorage.setItem('progress', '[]');
  new MutationObserver(() => {
    const seen = JSON.parse(sessionStorage.getItem('progress'));
    seen.push({hidden: box.hidden, percent: box.dataset.percent || null});
    sessionStorage.setItem('progress', JSON.stringify(seen));
  }).observe(box, {attributes: true});
}"""


def log_in(browser, server, username: str):
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.goto(server.url + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)
    return page


def confirm(page) -> None:
    dialog = page.locator("#confirm-dialog")
    dialog.wait_for(state="visible")
    dialog.locator("[data-dialog-ok]").click()


def upload(page, server, slug: str, zip_bytes: bytes, *, name: str = "", new_version_of: str = "") -> None:
    query = f"?adapter={new_version_of}" if new_version_of else ""
    page.goto(f"{server.url}/t/{slug}/adapters/upload/{query}")
    if name:
        page.fill("#id_name", name)
    page.set_input_files("#id_file", files=[{"name": "adapter.zip", "mimeType": "application/zip", "buffer": zip_bytes}])
    page.evaluate(WATCH_PROGRESS)
    with page.expect_navigation(url=lambda url: "/upload/" not in url):
        page.click("[data-testid=upload-submit]")
    states = page.evaluate("JSON.parse(sessionStorage.getItem('progress'))")
    assert {"hidden": False, "percent": "100"} in states, states


def test_staff_creates_a_tenant_and_its_first_member(browser, live_server_asgi):
    server = live_server_asgi
    UserFactory(username="ops", is_staff=True)
    UserFactory(username="dana", email="dana@acme.test")
    TenantFactory(slug="globex", name="Globex")
    page = log_in(browser, server, "ops")

    page.click("nav >> text=Tenants")
    page.click("[data-testid=new-tenant]")
    page.fill("#id_name", "Acme Corp")
    page.fill("#id_slug", "acme")
    page.click("button:has-text('Create tenant')")
    page.wait_for_url("**/platform/tenants/acme/")
    assert "Created Acme Corp" in page.inner_text(".alert-success")

    page.click("[data-testid=tenant-add-member]")
    page.fill("#id_username", "dana")
    page.select_option("#id_role", "owner")
    page.click("#add button[type=submit]")
    assert "Added dana as owner" in page.inner_text(".alert-success")
    assert page.locator("tr[data-member=dana]").count() == 1

    page.goto(server.url + "/platform/tenants/acme/")
    page.click("[data-testid=suspend]")
    confirm(page)
    page.wait_for_selector("[data-testid=reactivate]")
    assert "suspended" in page.inner_text("h1")

    # Searching filters the list in place (htmx swaps the table and keeps the URL shareable).
    page.click("nav >> text=Tenants")
    assert page.locator("#tenants-table tbody tr").count() == 2
    page.evaluate("window.__sameDocument = true")
    page.fill("input[name=q]", "acm")
    page.wait_for_url("**/platform/tenants/?q=acm*")
    page.wait_for_function("document.querySelectorAll('#tenants-table tbody tr').length === 1")
    assert page.evaluate("window.__sameDocument") is True
    assert page.get_attribute("#tenants-table tbody tr", "data-tenant") == "acme"

    membership = Membership.objects.get(tenant__slug="acme", user__username="dana")
    assert membership.role == "owner"
    actions = list(AuditLog.objects.filter(actor_user__username="ops").values_list("action", flat=True))
    assert {"tenant.create", "member.add", "tenant.suspend"} <= set(actions)


def test_a_member_runs_keys_adapters_and_usage_without_reloading(
    browser, live_server_asgi, media_dir, base_model, adapter_zips, tiny_base_dir, settings, screenshots
):
    server = live_server_asgi
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    MembershipFactory(tenant=tenant, user=UserFactory(username="dana"), role="developer")
    page = log_in(browser, server, "dana")
    assert page.url.endswith("/t/acme/")
    assert 'model": "support-bot"' not in page.inner_text("#quickstart")
    page.screenshot(path=str(screenshots / "20-first-run-overview.png"), full_page=True)

    # An API key: the secret is shown once, with a copy button and a warning, and it works.
    page.click("nav >> text=API keys")
    page.click("[data-testid=create-key]")
    page.fill("#id_name", "backend")
    page.check("input[name=scopes][value='usage:read']")
    page.click("[data-testid=create-key-submit]")
    secret = page.inner_text("[data-testid=key-secret]")
    assert "shown only once" in page.inner_text("#new-key")
    page.click("[data-copy='#new-secret']")
    page.wait_for_selector("[data-copy-label]:has-text('Copied')")
    page.reload()  # the page after the redirect: reloading creates nothing and shows the secret no more
    assert secret not in page.content()
    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    page.go_back()
    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    key = api_key_authenticate(presented=secret)
    assert key.name == "backend" and sorted(key.scopes) == ["inference", "usage:read"]

    # An adapter: upload with a progress bar, then validation goes to ready live (the worker starts only once
    # the page is open and connected, so the page can only learn it over the websocket).
    upload(page, server, "acme", adapter_zips[0], name="support-bot")
    assert page.url.endswith("/t/acme/adapters/support-bot/")
    page.wait_for_selector("body[data-live-connected=yes]")
    assert page.get_attribute("tr[data-version='1']", "data-status") in ("uploaded", "validating")
    page.evaluate("window.__sameDocument = true")
    page.evaluate(WATCH_READY)
    worker, engine = start_live_worker(media_dir), None
    try:
        page.wait_for_function("document.body.dataset.liveRefreshedBy === 'socket'", timeout=LIVE_TIMEOUT_MS)
        page.wait_for_selector("tr[data-version='1'][data-status=ready]", timeout=LIVE_TIMEOUT_MS)
        assert page.evaluate("window.__sameDocument") is True
        # Pushed, not polled: shown within 2 s of the worker committing the result, and no poll ran meanwhile.
        validated_at = AdapterVersion.objects.get(adapter__name="support-bot", number=1).validated_at
        shown_after = page.evaluate("window.__readyAt") / 1000 - validated_at.timestamp()
        assert shown_after < 2.0, f"validation result shown {shown_after:.2f} s after it was committed"
        assert page.evaluate("document.body.dataset.liveRefreshedBy") == "socket"
        page.screenshot(path=str(screenshots / "33-validation-pushed-live.png"), full_page=True)
        assert page.inner_text("[data-testid=current-version]") == "v1"

        # A second version, promoted with a confirmation.
        upload(page, server, "acme", adapter_zips[1], new_version_of="support-bot")
        page.wait_for_selector("tr[data-version='2'][data-status=ready]", timeout=LIVE_TIMEOUT_MS)
        page.click("[data-testid=promote-2]")
        confirm(page)
        page.wait_for_selector("text=now serves version 2")
        assert page.inner_text("[data-testid=current-version]") == "v2"

        # Usage: a request through the OpenAI-compatible API, served by a real engine with the new version;
        # the engine's usage event goes through the broker to the worker, and the chart shows it.
        page.click("nav >> text=Usage")
        assert page.locator("[data-testid=no-usage]").count() == 1
        engine, engine_url = start_engine(tiny_base_dir, media_dir, served_name=BASE_NAME, token=settings.QUILT_ENGINE_TOKEN)
        engine_register(actor=Actor.system(), name="cpu-0", url=engine_url)
        answer = httpx.post(
            server.url + "/v1/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=60,
            json={"model": "support-bot", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        expected = answer.json()["usage"]["total_tokens"]
        for _ in range(60):
            page.reload()
            if page.locator(".chart").count():
                break
            page.wait_for_timeout(500)
        assert page.get_attribute(".chart", "data-total-tokens") == str(expected)
        assert page.inner_text("[data-testid=usage-requests]") == "1"
        page.select_option("#u-group", "model")
        page.click("#usage-filters button[type=submit]")
        assert page.locator("#usage-table tbody tr").first.locator("code").inner_text() == "support-bot"
    finally:
        stop_worker(worker)
        if engine is not None:
            stop_worker(engine)


def test_a_viewer_sees_no_key_button_and_is_refused_when_posting_anyway(browser, live_server_asgi):
    server = live_server_asgi
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    MembershipFactory(tenant=tenant, user=UserFactory(username="vic"), role="viewer")
    page = log_in(browser, server, "vic")
    page.goto(server.url + "/t/acme/keys/")
    assert page.locator("[data-testid=create-key]").count() == 0
    assert page.locator("#create").count() == 0
    token = next(cookie["value"] for cookie in page.context.cookies() if cookie["name"] == "csrftoken")
    response = page.request.post(
        server.url + "/t/acme/keys/", form={"name": "sneaky", "scopes": "inference"},
        headers={"X-CSRFToken": token, "Referer": server.url + "/t/acme/keys/"},
    )  # fmt: skip
    assert response.status == 403
    assert not ApiKey.objects.filter(tenant=tenant).exists()


def test_a_member_of_tenant_a_can_not_open_tenant_b(browser, live_server_asgi):
    server = live_server_asgi
    tenant_a = TenantFactory(slug="acme", name="Acme Corp")
    TenantFactory(slug="globex", name="Globex")
    MembershipFactory(tenant=tenant_a, user=UserFactory(username="dana"), role="owner")
    page = log_in(browser, server, "dana")
    for path in ["", "keys/", "members/", "adapters/", "usage/", "billing/", "audit/"]:
        response = page.goto(f"{server.url}/t/globex/{path}")
        assert response.status == 404, path
    assert "Globex" not in page.inner_text("body")
    page.goto(server.url + "/t/acme/")
    assert page.locator("#tenant-switcher option").all_inner_texts() == ["Acme Corp"]


def test_uploads_are_refused_at_once_with_a_reason_and_every_chosen_file_is_listed(
    browser, live_server_asgi, base_model, adapter_zips, tmp_path, screenshots
):
    from tests.tiny_llama import save_peft_adapter, zipped

    server = live_server_asgi
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    MembershipFactory(tenant=tenant, user=UserFactory(username="dana"), role="developer")
    page = log_in(browser, server, "dana")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    cases = [
        ("adapter_model.bin", b"\x80\x04pickled", "is a pickle file"),
        ("adapter.zip", bytes(range(256)) * 16, "adapter.zip is not a readable zip archive"),
        ("config-only.zip", zipped(config_only), "no adapter_model.safetensors beside it"),
    ]
    for index, (name, data, reason) in enumerate(cases):
        page.goto(f"{server.url}/t/acme/adapters/upload/")
        page.fill("#id_name", "support-bot")
        page.set_input_files("#id_file", files=[{"name": name, "mimeType": "application/octet-stream", "buffer": data}])
        page.click("[data-testid=upload-submit]")
        errors = page.locator("[data-upload-errors]")
        errors.wait_for(state="visible")
        assert reason in errors.inner_text(), errors.inner_text()
        if index == 0:
            page.screenshot(path=str(screenshots / "22-upload-refused-pickle.png"), full_page=True)
    assert not AdapterVersion.objects.exists()

    folder = save_peft_adapter(tmp_path / "loose", seed=6)
    chosen = [str(folder / "adapter_config.json"), str(folder / "adapter_model.safetensors")]
    page.goto(f"{server.url}/t/acme/adapters/upload/")
    page.set_input_files("#id_file", files=chosen)
    listed = page.locator("[data-file-list] li").all_inner_texts()
    assert [item.split(" · ")[0] for item in listed] == ["adapter_config.json", "adapter_model.safetensors"]
    assert page.inner_text("[data-file-name]").startswith("2 files")
    page.screenshot(path=str(screenshots / "23-upload-two-files-listed.png"), full_page=True)
    page.fill("#id_name", "loose-bot")
    with page.expect_navigation(url=lambda url: "/upload/" not in url):
        page.click("[data-testid=upload-submit]")

    # The same bytes again: reported as identical to version 1, nothing new created.
    page.goto(f"{server.url}/t/acme/adapters/upload/?adapter=loose-bot")
    page.set_input_files("#id_file", files=chosen)
    page.click("[data-testid=upload-submit]")
    errors = page.locator("[data-upload-errors]")
    errors.wait_for(state="visible")
    assert "identical to version 1 of loose-bot" in errors.inner_text()
    assert AdapterVersion.objects.filter(adapter__name="loose-bot").count() == 1


def test_the_engines_page_shows_each_adapters_residency_and_a_refused_pin(browser, live_server_asgi):
    """What the engine reports per adapter (tier, pinned, rank: `adapters.residency` in its state) and the pins the
    platform asked for, a refused one with the engine's words."""
    from gateway.models import Engine, EnginePin
    from registry.models import Adapter, AdapterVersion, BaseModel

    server = live_server_asgi
    UserFactory(username="ops", is_staff=True)
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    base = BaseModel.objects.create(name="tiny-pins", checkpoint_dir="/nowhere", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    warm, cold = "c" * 64, "d" * 64
    for name, digest in (("warm", warm), ("cold", cold)):
        AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=tenant, name=name, base_model=base),
                                      number=1, digest=digest)  # fmt: skip
    residency = [AdapterResidency(warm, "device", True, 16), AdapterResidency(warm, "host", False, 16),
                 AdapterResidency(cold, "host", False, 8)]  # fmt: skip
    engine = Engine.objects.create(name="gpu-pins", url="http://10.0.0.9:8100", healthy=True, state=engine_state_json(
        adapters=adapters(gpu=[warm], host=[warm, cold], pinned={warm: "device"}, residency=residency)))
    EnginePin.objects.create(engine=engine, digest=warm, tier="gpu", status="pinned")
    EnginePin.objects.create(engine=engine, digest=cold, tier="gpu", status="refused",
                             message="device pins would hold 96 pages (32 for adapter dddddddddddd); the pool has 64 "
                                     "pages for adapters")  # fmt: skip
    page = log_in(browser, server, "ops")
    page.goto(server.url + "/platform/engines/")
    card = page.locator("[data-engine=gpu-pins]")
    rows = card.locator("[data-testid=residency] tbody tr")
    assert rows.count() == 3
    assert card.locator(f"tr[data-residency={warm[:12]}-GPU]").inner_text().split("\t") == \
        ["acme/warm@1", "GPU", "pinned", "16"]
    assert card.locator(f"tr[data-residency={warm[:12]}-Host]").inner_text().split("\t") == \
        ["acme/warm@1", "Host", "no", "16"]
    refused = card.locator(f"[data-pin={cold[:12]}]")
    assert refused.get_attribute("data-pin-status") == "refused"
    assert "acme/cold@1" in refused.inner_text() and "the pool has 64 pages for adapters" in refused.inner_text()
    assert card.locator(f"[data-pin={warm[:12]}]").get_attribute("data-pin-status") == "pinned"
