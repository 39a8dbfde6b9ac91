"""Fetching an image URL where the deployment allows it, against a real HTTP server on 127.0.0.2 (a network the
test's policy trusts) and a resolver the test controls: the allowlisted host's image comes back; a name that
resolves to loopback or to the cloud metadata address (169.254.169.254) is refused before any connection, and so is
a redirect to one, to a host off the allowlist or past the limit; a body past the byte cap and a server slower than
the timeout are cut off. Through the gateway's image check, a refused fetch is a 400 naming the content part."""

import asyncio
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.caller import Target
from gateway.errors import ApiError
from gateway.image_fetch import FetchPolicy, FetchRefused, fetch_image
from gateway.openai_request import parse_chat
from gateway.request_images import load_images
from tests.engine.pictures import picture
from tests.engine.test_vlm import oracle_processor

ADDRESSES = {"store.test": "127.0.0.2", "loopback.test": "127.0.0.1", "metadata.test": "169.254.169.254",
             "private.test": "10.1.2.3", "mapped.test": "::ffff:127.0.0.1", "elsewhere.test": "127.0.0.2"}  # fmt: skip


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    picture(60, 40, seed=5).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()


class ImageStore(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.seen.append((self.path, self.headers["Host"]))
        port = self.server.server_address[1]
        redirects = {"/to-loopback": f"http://loopback.test:{port}/ok", "/to-metadata": "http://metadata.test/latest/",
                     "/to-elsewhere": f"http://elsewhere.test:{port}/ok", "/loop": "/loop",
                     "/relative": "/ok"}  # fmt: skip
        if self.path in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[self.path])
            self.end_headers()
        elif self.path == "/ok":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            threading.Event().wait(2)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def store():
    server = ThreadingHTTPServer(("127.0.0.2", 0), ImageStore)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def resolve(host: str, port: int) -> list[str]:
    if host not in ADDRESSES:
        raise OSError(f"{host} does not resolve")
    return [ADDRESSES[host]]


def policy(**changes) -> FetchPolicy:
    settings = {"domains": ["store.test", "loopback.test", "metadata.test", "private.test", "mapped.test"],
                "allowed_networks": ["127.0.0.2/32"], "max_bytes": 100_000, "timeout_s": 1.0, "max_redirects": 3}
    return FetchPolicy(**settings | changes)


def fetch(url: str, **changes) -> bytes:
    return asyncio.run(fetch_image(url, policy(**changes), resolve=resolve))


def test_an_allowlisted_host_is_fetched_at_its_pinned_address_with_its_own_host_header(store):
    port = store.server_address[1]
    assert fetch(f"http://store.test:{port}/ok") == PNG
    assert store.seen[-1] == ("/ok", f"store.test:{port}")
    assert fetch(f"http://store.test:{port}/relative") == PNG  # a relative redirect on the same host


@pytest.mark.parametrize("host, address", [("loopback.test", "127.0.0.1"), ("metadata.test", "169.254.169.254"),
                                           ("private.test", "10.1.2.3"), ("mapped.test", "::ffff:127.0.0.1")])
def test_a_name_that_resolves_to_an_address_that_is_not_public_is_refused(store, host, address):
    seen = len(store.seen)
    with pytest.raises(FetchRefused, match=f"resolves to {address}, an address that is not public"):
        fetch(f"http://{host}:{store.server_address[1]}/ok")
    assert len(store.seen) == seen


@pytest.mark.parametrize("path, message", [
    ("/to-loopback", "resolves to 127.0.0.1, an address that is not public"),
    ("/to-metadata", "resolves to 169.254.169.254, an address that is not public"),
    ("/to-elsewhere", "'elsewhere.test' is not on this server's image allowlist"),
    ("/loop", "more than 3 redirects"),
])  # fmt: skip
def test_every_redirect_is_checked_again(store, path, message):
    with pytest.raises(FetchRefused, match=message):
        fetch(f"http://store.test:{store.server_address[1]}{path}")
    assert not any(p == "/ok" and host.startswith("loopback") for p, host in store.seen)


def test_hosts_off_the_allowlist_other_schemes_and_credentials_are_refused(store):
    port = store.server_address[1]
    for url, message in ((f"http://elsewhere.test:{port}/ok", "not on this server's image allowlist"),
                         ("ftp://store.test/ok", "only http and https"),
                         (f"http://user:pw@store.test:{port}/ok", "credentials")):  # fmt: skip
        with pytest.raises(FetchRefused, match=message):
            fetch(url)


def test_a_body_past_the_cap_and_a_slow_server_are_cut_off(store):
    port = store.server_address[1]
    with pytest.raises(FetchRefused, match=f"larger than {len(PNG) - 1} bytes"):
        fetch(f"http://store.test:{port}/ok", max_bytes=len(PNG) - 1)
    with pytest.raises(FetchRefused, match="longer than 0.3 s"):
        fetch(f"http://store.test:{port}/slow", timeout_s=0.3)


def vision_target(model_dir) -> Target:
    return Target(name="tiny-vl", base_model="tiny-vl", checkpoint_dir=str(model_dir), max_context=512,
                  adapter_id=None, adapter_version_id=None, adapter_version=None, digest=None, adapter_path=None)


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    from tests.engine.vlm_checkpoints import build_vlm

    return build_vlm(tmp_path_factory.mktemp("fetch-vl"), "qwen2_5_vl", seed=3)


def chat(url: str):
    return parse_chat({"model": "tiny-vl", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": url}}]}]})  # fmt: skip


def test_through_the_gateway_a_fetched_image_is_sent_on_as_a_data_url_and_a_refused_one_is_a_400(
        store, vision_model, settings):  # fmt: skip
    port = store.server_address[1]
    settings.QUILT_IMAGE_FETCH = True
    settings.QUILT_IMAGE_FETCH_DOMAINS = ["store.test", "metadata.test"]
    settings.QUILT_IMAGE_FETCH_ALLOWED_NETWORKS = ["127.0.0.2/32"]
    generation = chat(f"http://store.test:{port}/ok")
    asyncio.run(load_images(generation, vision_target(vision_model), resolve=resolve))
    assert generation.messages[0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    grid = oracle_processor(vision_model)([picture(60, 40, seed=5)], return_tensors="pt")["image_grid_thw"][0]
    assert generation.image_tokens == [int(grid.prod()) // 4]  # as transformers' processor sizes the image
    for path in ("/to-metadata", "/to-loopback"):
        with pytest.raises(ApiError) as raised:
            asyncio.run(load_images(chat(f"http://store.test:{port}{path}"), vision_target(vision_model), resolve=resolve))
        assert raised.value.status == 400 and raised.value.param == "messages.[0].content.[1]"
        assert raised.value.code == "image_url_not_allowed"


def test_fetching_is_off_by_default(vision_model, settings):
    assert settings.QUILT_IMAGE_FETCH is False
    with pytest.raises(ApiError) as raised:
        asyncio.run(load_images(chat("http://store.test/ok"), vision_target(vision_model), resolve=resolve))
    assert raised.value.code == "image_url_not_allowed" and "not fetched by this server" in raised.value.message
