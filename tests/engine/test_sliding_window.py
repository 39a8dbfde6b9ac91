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


INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="switches Triton to its interpreter for the process: CPU runs only")


@INTERPRETER_ONLY
def test_prompt_longer_than_the_window_matches_peft_on_the_triton_launchers(windowed):
    base, adapters, oracle = windowed
    interpreter.enable()
    try:
        assert kernels.backend_for(torch.zeros(1)) == "triton"
        _assert_like_peft(base, adapters, oracle)
    finally:
        interpreter.disable_routing()


@pytest.fixture(params=["references", pytest.param("triton-launchers", marks=INTERPRETER_ONLY)])
def kernel_path(request):
    if request.param == "references":
        yield
        return
    interpreter.enable()
    try:
        yield
    finally:
        interpreter.disable_routing()


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches(windowed, kernel_path):
    """The same long prompt again, after another request pushed its first blocks out of the cache: it still
    reuses the blocks its window reaches (a whole-context model would recompute it all), and answers alike."""
    base, adapters, oracle = windowed
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", block_size=4, num_kv_blocks=14, max_adapter_rank=8,
                                    max_num_batched_tokens=24, pool_adapter_bytes=0))  # fmt: skip
    prompt, filler = random_prompts(12, [40, 30])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(request_id, tokens):
        engine.add_request(request_id, tokens, params)
        seq = engine.requests[request_id][0]
        out = []
        while engine.has_unfinished():
            for step_out in engine.step():
                out.extend(step_out.new_token_ids)
        return seq, out

    first, first_tokens = run("a", prompt)
    run("filler", filler)
    first_key = engine.block_manager.keys(prompt[:4], adapter=None, salt=first.cache_salt)[0]
    assert first_key not in engine.block_manager.cached  # pushed out
    again, again_tokens = run("a-again", prompt)
    assert again.num_cached_tokens >= WINDOW  # a hit, without the prompt's first blocks
    assert first_tokens == again_tokens == oracle.greedy(prompt, None, 4)
    engine.block_manager.check_invariants([])


def test_sequences_longer_than_the_cache_run_in_their_windows(windowed):
    """14 blocks of 4 hold 56 tokens; with a window of 16, prompts of 80 and 61 tokens and their answers still
    run, side by side, as the blocks behind each window are given back (a whole-context model of this cache
    stops at 56 tokens)."""
    base, adapters, oracle = windowed
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", block_size=4, num_kv_blocks=14, max_adapter_rank=8,
                                    max_num_batched_tokens=24, pool_adapter_bytes=0))  # fmt: skip
    assert engine.max_model_len == 256  # the model's, not the cache's
    prompts = random_prompts(13, [80, 61])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.block_manager.check_invariants(engine.scheduler.running)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == oracle.greedy(prompt, None, 8)
    engine.block_manager.check_invariants([])


def test_the_cpu_cache_is_sized_for_windows_and_chunks(windowed):
    """Unsized on CPU, the cache holds max_num_seqs sequences of what each holds at once: a window of 16 and
    a chunk of 24 in blocks of 4 (11 blocks), not the model's 256 positions (64 blocks)."""
    base, _, _ = windowed
    config = EngineConfig(model=str(base), device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=24,
                          pool_adapter_bytes=0)  # fmt: skip
    engine = LLMEngine(config)
    assert engine.block_manager.num_blocks == 3 * 11
    assert engine.max_model_len == 256
