"""With S3 storage (moto's S3 server), the gateway hands an engine signed GET URLs of an adapter's files instead of a
path on a shared volume; an engine with only its own disk cache downloads them and serves the adapter as
transformers + PEFT do. With the filesystem storage (the embedded default) it hands the folder."""

import json
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from engine.contract import ADAPTER_FILES
from gateway.caller import caller_and_target
from registry.storage import blob_storage, canonical_key
from tests.engine.conftest import Oracle, launch_engine_server, wait_until_healthy
from tests.platform.conftest import key_client, tenant_a  # noqa: F401
from tests.registry.conftest import base_model, media_root, ready_version, tiny_base_dir  # noqa: F401
from tests.s3 import ACCESS_KEY, REGION, SECRET_KEY, s3_server
from tests.tiny_llama import save_peft_adapter, zipped

pytestmark = [pytest.mark.slow, pytest.mark.django_db]
TOKEN = "test-engine-token"


@pytest.fixture
def s3_storage(settings):
    with s3_server() as s3:
        options = {"bucket_name": s3.bucket, "endpoint_url": s3.endpoint_url, "access_key": ACCESS_KEY,
                   "secret_key": SECRET_KEY, "region_name": REGION, "signature_version": "s3v4"}
        settings.STORAGES = {**settings.STORAGES, "default": {"BACKEND": "storages.backends.s3.S3Storage",
                                                              "OPTIONS": options}}
        yield s3


@pytest.fixture
def peft_dir(tmp_path):
    return save_peft_adapter(tmp_path / "peft", seed=1)


def resolved_adapter(tenant, make_client, peft_dir) -> tuple[dict, str]:
    writer, _, _ = make_client(tenant, scopes=["adapters:write"])
    version = ready_version(writer, "bot", zipped(peft_dir))
    assert version.status == "ready", version.failure_message
    _, _, plaintext = make_client(tenant, scopes=["inference"])
    _, target = caller_and_target(authorization=f"Bearer {plaintext}", model="bot")
    return target.engine_adapter, version.digest


def test_with_s3_the_engine_is_handed_signed_urls_and_serves_what_it_downloads(
        s3_storage, tenant_a, key_client, base_model, tiny_base_dir, peft_dir, tmp_path, settings):  # noqa: F811
    adapter, digest = resolved_adapter(tenant_a, key_client, peft_dir)
    assert set(adapter) == {"digest", "urls"} and adapter["digest"] == digest, "no path on a shared volume"
    assert set(adapter["urls"]) == set(ADAPTER_FILES)
    storage = blob_storage()
    for name, url in adapter["urls"].items():
        query = parse_qs(urlsplit(url).query)
        assert query["X-Amz-Expires"] == [str(settings.QUILT_ADAPTER_URL_SECONDS)] and "X-Amz-Signature" in query
        with storage.open(f"{canonical_key(digest)}/{name}", "rb") as stored:
            assert httpx.get(url).content == stored.read()
    engine = launch_engine_server(
        ["--model", str(tiny_base_dir), "--usage-spool", str(tmp_path / "usage.jsonl"),
         "--adapter-disk-cache", str(tmp_path / "disk-cache")], log_path=tmp_path / "engine.log", token=TOKEN)
    try:
        wait_until_healthy(engine.process, engine, engine.log_path)
        prompt = [5, 9, 17, 3, 30]
        response = engine.post("/v1/generate", json={
            "request_id": "via-url", "tenant": "acme", "prompt_token_ids": prompt, "adapter": adapter, "stream": False,
            "sampling": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}})  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["token_ids"] == Oracle(tiny_base_dir, {"bot": peft_dir}).greedy(prompt, "bot", 4)
        assert (tmp_path / "disk-cache" / digest / ADAPTER_FILES[0]).is_file()
    finally:
        engine.process.kill()
        engine.process.wait()
        engine.close()


def test_with_the_filesystem_storage_the_engine_is_handed_the_folder(
        tenant_a, key_client, base_model, peft_dir, media_root):  # noqa: F811
    adapter, digest = resolved_adapter(tenant_a, key_client, peft_dir)
    assert adapter == {"digest": digest, "path": str(media_root / "adapters" / digest)}
    assert json.loads((media_root / "adapters" / digest / ADAPTER_FILES[0]).read_text())["digest"] == digest
