"""Operator commands: registerbasemodel refuses what the engine can't serve; importadapter validates at once."""

import json
import shutil

import pytest
from django.core.management import CommandError, call_command

from registry.models import Adapter, BaseModel
from registry.selectors import model_resolve
from tenancy.models import AuditLog
from tests.platform.factories import TenantFactory
from tests.registry.conftest import BASE_NAME
from tests.tiny_llama import save_peft_adapter

pytestmark = pytest.mark.django_db


def _broken_copy(tiny_base_dir, tmp_path, change):
    target = tmp_path / "checkpoint"
    shutil.copytree(tiny_base_dir, target)
    config = json.loads((target / "config.json").read_text())
    change(config, target)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _set(field, value):
    def change(config, target):
        config[field] = value

    return change


def _drop(field):
    def change(config, target):
        config.pop(field)

    return change


def _remove(name):
    def change(config, target):
        (target / name).unlink()

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("architectures", ["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not served"),
        (_set("architectures", ["MistralForCausalLM"]), "model_type 'llama' does not match architecture"),
        (_set("architectures", []), "must name one architecture"),
        (_drop("hidden_size"), "field 'hidden_size' is None"),
        (_set("num_hidden_layers", "2"), "field 'num_hidden_layers' is '2'"),
        (_set("num_key_value_heads", 3), "4 attention heads cannot share 3"),
        (_remove("model.safetensors"), "no *.safetensors weights"),
        (_remove("tokenizer.json"), "no tokenizer.json"),
    ],
)
def test_registerbasemodel_refuses_what_the_engine_cannot_serve(tiny_base_dir, tmp_path, change, message):
    checkpoint = _broken_copy(tiny_base_dir, tmp_path, change)
    with pytest.raises(CommandError, match=message.replace("*", r"\*").replace("(", r"\(")):
        call_command("registerbasemodel", "broken", str(checkpoint))
    assert not BaseModel.objects.exists() and not AuditLog.objects.exists()


def test_registerbasemodel_registers_and_refreshes(tiny_base_dir, tmp_path, capsys):
    call_command("registerbasemodel", BASE_NAME, str(tiny_base_dir), "--max-context", "64")
    model = BaseModel.objects.get(name=BASE_NAME)
    assert (model.architecture, model.max_context, model.config["hidden_size"]) == ("LlamaForCausalLM", 64, 32)
    call_command("registerbasemodel", BASE_NAME, str(tiny_base_dir))
    assert BaseModel.objects.get(name=BASE_NAME).max_context == 128
    assert list(AuditLog.objects.order_by("id").values_list("action", flat=True)) == [
        "base_model.register", "base_model.update"
    ]  # fmt: skip
    with pytest.raises(CommandError, match="between 1 and the model's 128 positions"):
        call_command("registerbasemodel", BASE_NAME, str(tiny_base_dir), "--max-context", "4096")
    with pytest.raises(CommandError, match="not a directory"):
        call_command("registerbasemodel", "x", str(tmp_path / "missing"))
    Adapter.objects.create(tenant=TenantFactory(), name="taken", base_model=BaseModel.objects.get())
    with pytest.raises(CommandError, match="adapter is named 'taken'"):
        call_command("registerbasemodel", "taken", str(tiny_base_dir))


def test_importadapter_validates_synchronously(tenant_a, base_model, tmp_path, media_root, capsys):
    folder = save_peft_adapter(tmp_path / "peft", seed=11)
    call_command("importadapter", tenant_a.slug, "ops-bot", str(folder))
    assert "ops-bot@1 ready" in capsys.readouterr().out
    assert model_resolve(tenant=tenant_a, name="ops-bot").version.status == "ready"
    with pytest.raises(CommandError, match="identical to version 1 of ops-bot"):
        call_command("importadapter", tenant_a.slug, "ops-bot", str(folder))
    call_command("importadapter", tenant_a.slug, "ops-bot", str(save_peft_adapter(tmp_path / "v2", seed=13)))
    adapter = Adapter.objects.get(name="ops-bot")
    assert [v.status for v in adapter.versions.order_by("number")] == ["ready", "ready"]
    assert adapter.current_version.number == 1
    wide = save_peft_adapter(tmp_path / "wide", seed=12, hidden_size=48)
    with pytest.raises(CommandError, match="ops-bot@3 failed validation: layer 0"):
        call_command("importadapter", tenant_a.slug, "ops-bot", str(wide))
    with pytest.raises(CommandError, match="No tenant 'nobody'"):
        call_command("importadapter", "nobody", "x", str(folder))
