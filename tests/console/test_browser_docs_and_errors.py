"""Pages that must work with no internet and no debug: the API docs (ReDoc and Swagger UI from our own static
files), and the friendly 404 page. Real Chromium against the ASGI server, every request off this server refused."""

from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def offline_page(browser, server):
    """A page whose requests to anywhere but the server fail, as on a machine with no internet."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    outside = []
    host = urlparse(server.url).netloc

    def route(request_route):
        if urlparse(request_route.request.url).netloc == host:
            request_route.continue_()
        else:
            outside.append(request_route.request.url)
            request_route.abort()

    context.route("**/*", route)
    return context.new_page(), outside


def test_the_api_docs_render_offline(browser, live_server_asgi, screenshots):
    page, outside = offline_page(browser, live_server_asgi)
    page.goto(live_server_asgi.url + "/api/docs/")
    page.wait_for_selector("h1:has-text('Quilt management API')", timeout=30_000)
    page.get_by_text("/api/v1/adapters").first.wait_for(timeout=30_000)
    page.screenshot(path=str(screenshots / "24-api-docs-offline.png"))
    page.goto(live_server_asgi.url + "/api/docs/swagger/")
    page.wait_for_selector(".swagger-ui .title:has-text('Quilt management API')", timeout=30_000)
    page.screenshot(path=str(screenshots / "25-api-swagger-offline.png"))
    assert outside == []


def test_a_missing_page_is_the_consoles_own_404(browser, live_server_asgi, screenshots):
    page, outside = offline_page(browser, live_server_asgi)
    response = page.goto(live_server_asgi.url + "/no/such/page/")
    assert response.status == 404
    assert page.inner_text("h1") == "Nothing here"
    assert page.locator("a.btn:has-text('Back to the console')").count() == 1
    page.screenshot(path=str(screenshots / "26-not-found.png"))
    assert outside == []


def test_the_api_docs_have_a_language_no_console_errors_and_every_operation_in_words(browser, live_server_asgi):
    page, outside = offline_page(browser, live_server_asgi)
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(live_server_asgi.url + "/api/docs/")
    page.get_by_text("Create a chat completion").first.wait_for(state="attached", timeout=30_000)
    page.wait_for_timeout(1_000)
    assert page.get_attribute("html", "lang") == "en"
    assert errors == [] and outside == []
    for tag in ("API keys", "Request log", "Billing", "Inference (OpenAI-compatible)", "Fine-tuning (OpenAI-compatible)"):
        assert page.get_by_text(tag).count() >= 1, tag
    page.context.close()
