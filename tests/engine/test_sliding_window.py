"""A sliding window is a span of attention, not a context limit: Mistral with a window of 16 serves prompts
and generations far longer than 16, token for token as transformers + PEFT, on the references and on the
Triton launchers (Triton's interpreter on CPU tensors)."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import kernels
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kernels import interpreter
from tests.engine.conftest import VOCAB, Oracle, build_adapter, build_tokenizer, random_prompts
from tests.engine.test_llm_vs_peft import ALL

WINDOW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral whose every layer sees only the last 16 tokens, with two adapters."""
    root = tmp_path_factory.mktemp("mistral-window")
    config = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                           initializer_range=0.15, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW)  # fmt: skip
    torch.manual_seed(5)
    base = root / "base"
    MistralForCausalLM(config).eval().save_pretrained(base)
    build_tokenizer(base)
    adapters = {
        "all": build_adapter(base, root / "all", seed=30, r=4, targets=ALL),
        "qv": build_adapter(base, root / "qv", seed=31, r=8, targets=["q_proj", "v_proj"]),
    }
    return base, adapters, Oracle(base, adapters)


def _assert_like_peft(base, adapters, oracle):
    """Greedy tokens of a mixed batch equal PEFT's, while no running sequence holds more blocks than its
    window needs: the blocks before it are given back as it goes."""
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", block_size=4, num_kv_blocks=96, max_adapter_rank=64,
                                    max_num_batched_tokens=24))  # fmt: skip
    digests = {name: engine.add_adapter(path) for name, path in adapters.items()}
    names = [None, "all", "qv", "all"]
    prompts = random_prompts(11, [40, 33, 5, 17])  # longer than the window, chunked across it, shorter
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, adapter=name and digests[name])
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = engine.scheduler.running
        engine.block_manager.check_invariants(running)
        most_held = max([most_held] + [len(s.block_table) - s.num_freed_blocks for s in running])
    assert most_held <= -(-(WINDOW + 4) // 4) + 1  # the window's blocks and the next token's (48 tokens: 12)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert tokens[str(i)] == oracle.greedy(prompt, name, GREEDY.max_tokens), f"adapter {name}, {len(prompt)} tokens"
    engine.block_manager.check_invariants([])
    return prompts


def test_prompt_longer_than_the_window_matches_peft(windowed):
    base, adapters, oracle = windowed
    prompts = _assert_like_peft(base, adapters, oracle)
    # the window matters: the same model attending to the whole context answers otherwise
    full = Oracle(base, {})
    full.base.config.sliding_window = None
    assert full.greedy(prompts[0], None, GREEDY.max_tokens) != oracle.greedy(prompts[0], None, GREEDY.max_tokens)


def test_prompt_longer_than_the_window_matches_peft_on_the_triton_launchers(windowed):
    base, adapters, oracle = windowed
    interpreter.enable()
    try:
        assert kernels.backend_for(torch.zeros(1)) == "triton"
        _assert_like_peft(base, adapters, oracle)
    finally:
        interpreter.disable_routing()
