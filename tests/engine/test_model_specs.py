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


# the fields that matter of configs as the Hub has them (older transformers: no layer_types, rope_theta and
# rope_scaling at the top, Gemma 3's rope_local_base_freq and sliding_window_pattern)
GEMMA_2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
              "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
              "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0, "max_position_embeddings": 8192}
GEMMA_3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
              "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
              "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
              "attn_logit_softcapping": None, "max_position_embeddings": 32768}
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
              "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000, "rope_scaling": None,
              "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28, "hidden_act": "silu",
              "attention_bias": False, "tie_word_embeddings": True, "max_position_embeddings": 40960}
QWEN2_5_YARN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
                "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": 131072,
                "use_sliding_window": False, "max_window_layers": 28, "hidden_act": "silu",
                "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
                "max_position_embeddings": 32768}


def test_hub_configs_of_the_new_families_read_as_transformers_reads_them():
    gemma2 = read_spec(GEMMA_2_2B)
    assert gemma2.layer_windows == (4096, None) * 13 and gemma2.scale == 256**-0.5
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.norm_offset) == (50.0, 30.0, 1.0)
    assert gemma2.embed_scale == 2304**0.5 and gemma2.activation == "gelu_tanh" and not gemma2.qk_norm
    gemma3 = read_spec(GEMMA_3_1B)
    assert gemma3.layer_windows == ((512,) * 5 + (None,)) * 4 + (512, 512)  # 5 local : 1 global
    assert (gemma3.rope.theta, gemma3.local_rope.theta) == (1e6, 1e4) and gemma3.qk_norm
    assert gemma3.layer_rope(0) is gemma3.local_rope and gemma3.layer_rope(5) is gemma3.rope
    qwen3 = read_spec(QWEN3_0_6B)
    assert qwen3.head_dim == 128 and qwen3.qk_norm and qwen3.layer_windows == (None,) * 28
    assert (qwen3.qkv_bias, qwen3.tie_word_embeddings, qwen3.rope.theta) == (False, True, 1e6)
    qwen25 = read_spec(QWEN2_5_YARN)
    assert qwen25.qkv_bias and not qwen25.o_bias and qwen25.layer_windows == (None,) * 28
    assert qwen25.rope.scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
