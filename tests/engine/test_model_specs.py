"""Model families are read from config.json once, into a spec; what is not served is refused when the engine
starts, naming what is."""

import json
import shutil

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import MODELS, read_spec
from engine.models.spec import ROPE_TYPES


def _edited(checkpoint, directory, **changes):
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_an_unsupported_architecture_is_refused_at_start_listing_the_supported(checkpoints, tmp_path):
    model = _edited(checkpoints["llama"], tmp_path / "m", architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'; supported: ") as error:
        LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8))
    assert all(name in str(error.value) for name in MODELS)


def test_an_unsupported_rope_type_is_refused_at_start_listing_the_supported(checkpoints, tmp_path):
    scaling = {"rope_type": "su-per", "factor": 2.0}
    model = _edited(checkpoints["llama"], tmp_path / "m", rope_scaling=scaling, rope_parameters=scaling)
    with pytest.raises(ValueError, match=f"unsupported rope_type 'su-per'; supported: {', '.join(ROPE_TYPES)}"):
        LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8))


def _config(**extra):
    return {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2, **extra}


@pytest.mark.parametrize(("config", "windows"), [
    (_config(sliding_window=16), (16, 16, 16, 16)),  # Mistral: every layer
    (_config(sliding_window=None), (None,) * 4),
    (_config(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=False), (None,) * 4),
    (_config(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True, max_window_layers=3),
     (None, None, None, 16)),
    (_config(sliding_window=16, layer_types=["full_attention", "sliding_attention"] * 2), (None, 16, None, 16)),
], ids=["mistral", "mistral-no-window", "qwen2-window-off", "qwen2-max-window-layers", "layer-types"])
def test_each_layer_gets_its_window_from_either_config_shape(config, windows):
    assert read_spec(config).layer_windows == windows


def test_legacy_and_current_rope_fields_read_alike():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    legacy = read_spec(_config(architectures=["LlamaForCausalLM"], rope_theta=5e5, rope_scaling=llama3)).rope
    current = read_spec(_config(architectures=["LlamaForCausalLM"], rope_parameters={**llama3, "rope_theta": 5e5})).rope
    assert legacy == current and legacy.theta == 5e5 and legacy.scaling == llama3 and legacy.rotary_dim == 4
