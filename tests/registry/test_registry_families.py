"""The registry's upload checks know each family: Phi-3 adapters in both naming styles become ready on a Phi-3
base, and an adapter targeting a module the base lacks is refused at upload, naming the module and the family."""

import pytest

from registry.base_models import base_model_register
from registry.models import AdapterVersion
from registry.validation import adapter_version_validate
from tenancy.audit import Actor
from tests.registry.conftest import create_adapter, upload
from tests.tiny_llama import save_phi3_adapter, save_tiny_base, zipped

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def phi3_base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny-phi3"), phi3=True)


@pytest.fixture
def phi3_base(db, phi3_base_dir, media_root):
    return base_model_register(actor=Actor.system(), name="tiny-phi3", checkpoint_dir=phi3_base_dir)


@pytest.fixture
def writer(tenant_a, key_client):
    return key_client(tenant_a, scopes=["adapters:write"])[0]


def create_on(client, base: str, name: str, data: bytes):
    body = {"name": name, "base_model": base, "file": upload("adapter.zip", data)}
    return client.post("/api/v1/adapters", body, format="multipart")


def test_phi3_adapters_with_fused_and_split_names_become_ready(writer, phi3_base, tmp_path):
    fused = zipped(save_phi3_adapter(tmp_path / "fused", seed=1, fused=True))
    split = zipped(save_phi3_adapter(tmp_path / "split", seed=2, fused=False))
    for name, data, modules in (("fused", fused, ["qkv_proj", "gate_up_proj"]),
                                ("split", split, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])):
        assert create_on(writer, "tiny-phi3", name, data).status_code == 201
        version = adapter_version_validate(version_id=AdapterVersion.objects.get(adapter__name=name).pk)
        assert version.status == "ready", version.failure_message
        assert version.target_modules == modules


def test_a_module_the_phi3_base_lacks_is_refused_at_upload(writer, phi3_base, tmp_path):
    directory = save_phi3_adapter(tmp_path / "fused", seed=1, fused=True)
    config = directory / "adapter_config.json"
    config.write_text(config.read_text().replace('"qkv_proj"', '"qkv_proj", "dense"'))
    response = create_on(writer, "tiny-phi3", "dense", zipped(directory))
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert error["code"] == "unsupported_module"
    assert error["message"].startswith("target_modules names dense, which a Phi-3 base (Phi3ForCausalLM) does not have")
    assert not AdapterVersion.objects.exists()


def test_a_phi3_fused_adapter_is_refused_on_a_llama_base_at_upload(writer, base_model, tmp_path):
    response = create_adapter(writer, "fused", zipped(save_phi3_adapter(tmp_path / "f", seed=1, fused=True, targets=["qkv_proj"])))
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert error["code"] == "unsupported_module"
    assert "qkv_proj, which a Llama base (LlamaForCausalLM) does not have" in error["message"]
