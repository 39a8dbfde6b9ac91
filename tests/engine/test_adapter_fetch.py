"""Adapters from remote storage: the engine downloads each blob through the signed GET URLs a request hands it, from
a real S3-compatible server (moto's, in server mode), checks it whole and keeps it in a disk cache bounded in
bytes. Tokens are held to transformers + PEFT.

A gate (a plain HTTP server that relays moto's answer only when the test opens it) stands in front of S3 where a
test needs a download held: the engine sees a slow object store."""

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import adapters
from tests.engine.conftest import (
    Oracle,
    build_adapter,
    launch_engine_server,
    metric,
    random_prompts,
    wait_until_healthy,
)
from tests.s3 import s3_server

pytestmark = pytest.mark.slow
TOKEN = "test-engine-token"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FILES = ("quilt_adapter.json", "adapter_model.safetensors")
BUCKET = "quilt-blobs"
MAX_TOKENS = 4
NAMES = ("a", "b", "slow", "late", "stuck", "c", "d", "e")
DOWNLOAD_TIMEOUT_S = 10  # past the slow test's hold (a few requests), short enough to wait out once
CACHED_BLOBS = 2.5  # the disk cache's bound, in blobs of the largest adapter


class Gate:
    """An HTTP origin that answers each registered path with the bytes of an S3 URL, once the path is opened."""

    def __init__(self) -> None:
        self.routes: dict[str, str] = {}
        self.opened: dict[str, threading.Event] = {}
        self.hits: dict[str, int] = {}
        gate = self

        class Relay(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                gate.hits[self.path] = gate.hits.get(self.path, 0) + 1
                gate.opened[self.path].wait(timeout=60)
                body = httpx.get(gate.routes[self.path]).content
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def route(self, name: str, url: str) -> str:
        path = f"/{uuid.uuid4().hex}/{name}"
        self.routes[path], self.opened[path] = url, threading.Event()
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def open(self) -> None:
        for event in self.opened.values():
            event.set()

    def close(self) -> None:
        self.open()
        self.server.shutdown()


@pytest.fixture(scope="module")
def peft_dirs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fetch-peft")
    return {name: build_adapter(checkpoints["llama"], root / name, seed=80 + k, r=4, targets=TARGETS)
            for k, name in enumerate(NAMES)}  # one rank: blobs of one size, so the bound holds two of them


@pytest.fixture(scope="module")
def oracle(checkpoints, peft_dirs):
    return Oracle(checkpoints["llama"], peft_dirs)


@pytest.fixture(scope="module")
def canonical(checkpoints, peft_dirs, tmp_path_factory):
    """Each adapter's canonical folder, as the control plane stores it, and its digest."""
    root = tmp_path_factory.mktemp("fetch-canonical")
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    out = {}
    for name, path in peft_dirs.items():
        adapter = adapters.load_adapter(path, config)
        out[name] = (adapter.digest, adapter.save(root / name))
    return out


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server and a boto3 client for it."""
    with s3_server(BUCKET) as server:
        yield server.client


def upload(s3, digest: str, folder) -> None:
    for name in FILES:
        s3.put_object(Bucket=BUCKET, Key=f"adapters/{digest}/{name}", Body=(folder / name).read_bytes())


def signed_urls(s3, digest: str) -> dict[str, str]:
    return {name: s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": f"adapters/{digest}/{name}"},
                                            ExpiresIn=300) for name in FILES}


def blob_bytes(folder) -> int:
    return sum((folder / name).stat().st_size for name in FILES)


@pytest.fixture(scope="module")
def bound(canonical) -> int:
    return int(CACHED_BLOBS * max(blob_bytes(folder) for _, folder in canonical.values()))


@pytest.fixture(scope="module")
def server(checkpoints, bound, tmp_path_factory):
    root = tmp_path_factory.mktemp("fetch-engine")
    client = launch_engine_server(
        ["--model", str(checkpoints["llama"]), "--usage-spool", str(root / "usage.jsonl"),
         "--adapter-disk-cache", str(root / "disk-cache"), "--adapter-disk-cache-bytes", str(bound),
         "--adapter-download-timeout", str(DOWNLOAD_TIMEOUT_S)], log_path=root / "engine.log", token=TOKEN)  # fmt: skip
    wait_until_healthy(client.process, client, client.log_path)
    client.cache_dir = root / "disk-cache"
    yield client
    client.process.kill()
    client.process.wait()
    client.close()


@pytest.fixture
def gate():
    gate = Gate()
    yield gate
    gate.close()


def generate(server, prompt: list[int], adapter: dict | None = None, timeout: float = 60) -> httpx.Response:
    body = {"request_id": uuid.uuid4().hex, "tenant": "acme", "prompt_token_ids": prompt, "adapter": adapter,
            "stream": False, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    return server.post("/v1/generate", json=body, timeout=timeout)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


def downloads(server, outcome: str = "ok") -> float:
    return metric(server, "quilt_engine_adapter_downloads_total", outcome=outcome)


def cache_bytes_on_disk(server) -> int:
    return sum(path.stat().st_size for path in server.cache_dir.rglob("*") if path.is_file())


def test_an_adapter_fetched_by_signed_url_serves_as_transformers_peft(server, s3, canonical, oracle):
    prompts = random_prompts(81, [6, 5])
    before = downloads(server)
    for name, prompt in zip(("a", "b"), prompts, strict=True):
        digest, folder = canonical[name]
        upload(s3, digest, folder)
        ref = {"digest": digest, "urls": signed_urls(s3, digest)}
        assert tokens(generate(server, prompt, ref)) == oracle.greedy(prompt, name, MAX_TOKENS)
        assert (server.cache_dir / digest / FILES[1]).read_bytes() == (folder / FILES[1]).read_bytes()
        # the next request finds it here: no second download
        assert tokens(generate(server, prompt, ref)) == oracle.greedy(prompt, name, MAX_TOKENS)
    assert downloads(server) == before + 2


def test_a_slow_download_holds_only_its_own_requests_and_downloads_once(server, s3, canonical, oracle, gate):
    slow_digest, slow_folder = canonical["slow"]
    upload(s3, slow_digest, slow_folder)
    urls = {name: gate.route(name, url) for name, url in signed_urls(s3, slow_digest).items()}
    prompts = random_prompts(82, [5, 7, 6, 4])
    before = downloads(server)
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(generate, server, prompts[k], {"digest": slow_digest, "urls": urls}) for k in range(3)]
        deadline = time.monotonic() + 30
        while sum(gate.hits.values()) == 0:
            assert time.monotonic() < deadline, "the engine never asked for the blob"
            time.sleep(0.02)
        # the store holds the blob back: other adapters and the base model keep serving meanwhile
        digest, folder = canonical["a"]
        upload(s3, digest, folder)
        ref = {"digest": digest, "urls": signed_urls(s3, digest)}
        assert tokens(generate(server, prompts[3], ref)) == oracle.greedy(prompts[3], "a", MAX_TOKENS)
        assert tokens(generate(server, prompts[3])) == oracle.greedy(prompts[3], None, MAX_TOKENS)
        assert not any(future.done() for future in waiting)
        gate.open()
        for k, future in enumerate(waiting):
            assert tokens(future.result()) == oracle.greedy(prompts[k], "slow", MAX_TOKENS)
    assert sorted(gate.hits.values()) == [1, 1], "one download for the three requests"
    assert downloads(server) - before in (1, 2)  # the slow one, and "a" if the cache had let it go
    assert downloads(server, "failed") == 0


def test_a_failed_download_fails_only_its_requests_and_the_next_request_downloads_again(server, s3, canonical,
                                                                                         oracle):
    digest, folder = canonical["late"]
    ref = {"digest": digest, "urls": signed_urls(s3, digest)}  # signed, but nothing stored there yet
    prompts = random_prompts(83, [6, 5])
    failed = downloads(server, "failed")
    response = generate(server, prompts[0], ref)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "adapter_unavailable" and error["param"] == "adapter"
    assert error["message"] == f"adapter {digest[:12]} could not be loaded: its download was answered HTTP 404"
    assert "X-Amz-Signature" not in response.text
    assert tokens(generate(server, prompts[1])) == oracle.greedy(prompts[1], None, MAX_TOKENS)
    assert downloads(server, "failed") == failed + 1
    assert not (server.cache_dir / digest).exists()
    upload(s3, digest, folder)
    assert tokens(generate(server, prompts[0], ref)) == oracle.greedy(prompts[0], "late", MAX_TOKENS)


def test_a_download_past_its_time_fails_only_its_requests_and_the_next_request_downloads_again(server, s3, canonical,
                                                                                             oracle, gate):
    digest, folder = canonical["stuck"]
    upload(s3, digest, folder)
    held = {name: gate.route(name, url) for name, url in signed_urls(s3, digest).items()}  # never opened
    prompts = random_prompts(87, [5, 6])
    with ThreadPoolExecutor(2) as pool:
        stuck = [pool.submit(generate, server, prompts[k], {"digest": digest, "urls": held}) for k in range(2)]
        assert tokens(generate(server, prompts[1])) == oracle.greedy(prompts[1], None, MAX_TOKENS)
        for future in stuck:
            response = future.result()
            assert response.status_code == 503, response.text
            assert response.json()["error"]["message"] == (
                f"adapter {digest[:12]} could not be loaded: its download took longer than {DOWNLOAD_TIMEOUT_S} s")
    assert sum(gate.hits.values()) == 1, "one download for both requests"
    assert not [p for p in server.cache_dir.iterdir() if p.name.startswith(".staging-")]
    ref = {"digest": digest, "urls": signed_urls(s3, digest)}
    assert tokens(generate(server, prompts[0], ref)) == oracle.greedy(prompts[0], "stuck", MAX_TOKENS)


@pytest.mark.parametrize("fault", ["another adapter's blob", "flipped weights byte"])
def test_a_blob_that_does_not_match_its_digest_is_refused_and_never_served(server, s3, canonical, tmp_path, fault):
    digest, folder = canonical["c"]
    other_digest, other_folder = canonical["d"]
    if fault == "another adapter's blob":
        upload(s3, digest, other_folder)  # a well-formed adapter, stored under the wrong digest
    else:
        upload(s3, digest, folder)
        weights = bytearray((folder / FILES[1]).read_bytes())
        weights[-1] ^= 0xFF
        s3.put_object(Bucket=BUCKET, Key=f"adapters/{digest}/{FILES[1]}", Body=bytes(weights))
    ref = {"digest": digest, "urls": signed_urls(s3, digest)}
    prompt = random_prompts(84, [5])[0]
    for _ in range(2):  # refused, and refused again: never kept
        response = generate(server, prompt, ref)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "adapter_unavailable"
        assert response.json()["error"]["message"].startswith(f"adapter {digest[:12]} could not be loaded: ")
        assert not (server.cache_dir / digest).exists()
    assert not [p for p in server.cache_dir.iterdir() if p.name.startswith(".staging-")]
    s3.delete_object(Bucket=BUCKET, Key=f"adapters/{digest}/{FILES[0]}")  # for the next parametrization
    s3.delete_object(Bucket=BUCKET, Key=f"adapters/{digest}/{FILES[1]}")


def test_a_cached_blob_whose_bytes_changed_on_disk_is_refused_and_downloaded_again(server, s3, canonical, oracle):
    digest, folder = canonical["b"]
    upload(s3, digest, folder)
    ref = {"digest": digest, "urls": signed_urls(s3, digest)}
    prompt = random_prompts(86, [6])[0]
    expected = oracle.greedy(prompt, "b", MAX_TOKENS)
    assert tokens(generate(server, prompt, ref)) == expected
    assert server.delete(f"/v1/adapters/{digest}").status_code == 200  # out of memory: the next read is from disk
    weights = server.cache_dir / digest / FILES[1]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40
    weights.write_bytes(data)
    fetched = downloads(server)
    response = generate(server, prompt, ref)
    assert response.status_code == 503 and response.json()["error"]["type"] == "adapter_unavailable", response.text
    assert not (server.cache_dir / digest).exists()
    assert tokens(generate(server, prompt, ref)) == expected
    assert downloads(server) == fetched + 1


def test_the_disk_cache_never_exceeds_its_bound(server, s3, canonical, oracle, bound):
    prompt = random_prompts(85, [6])[0]
    order = ["c", "d", "e", "c"]  # three blobs past a bound of two and a half: "c" is let go, then fetched again
    for name in order:
        digest, folder = canonical[name]
        upload(s3, digest, folder)
        ref = {"digest": digest, "urls": signed_urls(s3, digest)}
        assert tokens(generate(server, prompt, ref)) == oracle.greedy(prompt, name, MAX_TOKENS)
        on_disk = cache_bytes_on_disk(server)
        assert on_disk <= bound
        assert metric(server, "quilt_engine_adapter_disk_cache_bytes") == on_disk
    assert not (server.cache_dir / canonical["d"][0]).exists(), "the least recently used blob was let go"
    assert {p.name for p in server.cache_dir.iterdir()} == {canonical["e"][0], canonical["c"][0]}
