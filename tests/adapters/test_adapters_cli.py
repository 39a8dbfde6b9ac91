"""`python -m adapters` validates like an upload and says why it refuses."""

import json

from adapters import load_canonical
from adapters.__main__ import main
from tests.adapters.builders import lora_config, peft_lora_tensors, write_adapter


def test_cli_reports_and_saves(tmp_path, llama_base, capsys):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(llama_base))
    adapter = write_adapter(tmp_path / "adapter")
    assert main([str(adapter), str(tmp_path / "base"), "--save", str(tmp_path / "canonical")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["rank"] == 4 and report["target_modules"] == ["q_proj", "v_proj"]
    assert load_canonical(tmp_path / "canonical").digest == report["digest"]


def test_cli_refusal_exit_status(tmp_path, llama_base, capsys):
    (tmp_path / "config.json").write_text(json.dumps(llama_base))
    config = lora_config(r=8)
    adapter = write_adapter(tmp_path / "adapter", config=config, tensors=peft_lora_tensors(config))
    assert main([str(adapter), str(tmp_path / "config.json"), "--max-rank", "4"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report == {"ok": False, "code": "rank_too_large", "message": report["message"]}
    assert "serves ranks up to 4" in report["message"]
