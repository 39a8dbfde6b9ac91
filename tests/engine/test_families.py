"""Qwen3, Gemma 2, Gemma 3, and Qwen2.5 with a yarn rope against
transformers + PEFT: base requests and several adapters on every projection mixed in one batch, prompts
longer than the sliding window, chunked prefill over 4-token pages; greedy tokens equal and the top-1
log-probability of every generated token within 1e-4. On the reference ops here; on the Triton launchers
(interpreted) in test_families_triton.py; over 2 ranks in test_tensor_parallel.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.quantization.on_load import dequantize, quantize_int8
from tests.engine.conftest import FAMILIES, Oracle, build_adapter, build_tokenizer, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
# small pages and steps: windows span pages, and prompts are prefilled in chunks over cached pages
CONFIG = {"block_size": 4, "num_kv_blocks": 160, "max_num_batched_tokens": 16, "max_adapter_rank": 16}
SHARED = random_prompts(70, [19])[0]  # longer than every window; asked of the base and of each adapter


def family_adapters(base, root) -> dict:
    return {
        "all4": build_adapter(base, root / "all4", seed=30, r=4, targets=ALL),
        "all8": build_adapter(base, root / "all8", seed=31, r=8, targets=ALL, use_rslora=True),
        "attn2": build_adapter(base, root / "attn2", seed=32, r=2, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                               alpha=8.0),
    }


@pytest.fixture(scope="module")
def checkpoint(checkpoints, request):
    return request.param, checkpoints[request.param]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    arch, base = checkpoint
    return family_adapters(base, tmp_path_factory.mktemp(f"{arch}-adapters"))


def make_llm(base, adapters, **config) -> LLM:
    llm = LLM(base, device="cpu", **{**CONFIG, **config})
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def peft_greedy(oracle: Oracle, prompt: list[int], adapter: str | None, max_tokens: int):
    """transformers + PEFT's greedy tokens and the log-probability of each."""
    tokens, logprobs = list(prompt), []
    for _ in range(max_tokens):
        row = torch.log_softmax(oracle.logits(tokens, adapter)[-1], dim=-1)
        tokens.append(int(row.argmax()))
        logprobs.append(float(row.max()))
    return tokens[len(prompt):], logprobs


def assert_matches_peft(oracle, prompts, names, outputs, max_tokens=MAX_TOKENS) -> None:
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        tokens, logprobs = peft_greedy(oracle, prompt, name, max_tokens)
        assert out.token_ids == tokens, f"adapter {name}, prompt of {len(prompt)}"
        got = [entry.logprob for entry in out.logprobs]
        assert got == pytest.approx(logprobs, abs=1e-4), f"adapter {name}, prompt of {len(prompt)}"


def mixed_batch(seed: int):
    """Base and adapter requests, the shared prompt once per adapter and for the base, short prompts and ones
    longer than the window (8)."""
    names = [None, "all4", "all8", "attn2", "all8", None, "all4", "attn2", None, "all4", "all8", "attn2"]
    prompts = random_prompts(seed, [3, 13, 21, 9, 30, 17, 1, 26]) + [SHARED] * 4
    return prompts, names


@pytest.mark.parametrize("checkpoint", [*FAMILIES, "qwen2-yarn"], indirect=True)
def test_mixed_adapter_batch_matches_peft(checkpoint, adapters):
    arch, base = checkpoint
    oracle = Oracle(base, adapters)
    llm = make_llm(base, adapters)
    prompts, names = mixed_batch(71)
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    # every adapter changes the output: one that loads but adds nothing would match the base here
    shared = [tuple(round(entry.logprob, 3) for entry in out.logprobs) for out in outputs[-4:]]
    assert len(set(shared)) == 4, f"{arch}: an adapter's output equals another's or the base's"


def _dequantized_int8(base, directory):
    """The checkpoint with every decoder projection replaced by its int8 dequantization."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ALL:
            module.weight.data = dequantize(*quantize_int8(module.weight.data))
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


@pytest.mark.parametrize("checkpoint", ["gemma2"], indirect=True)
def test_int8_matches_peft_on_the_dequantized_base(checkpoint, adapters, tmp_path):
    arch, base = checkpoint
    oracle = Oracle(_dequantized_int8(base, tmp_path / "int8"), adapters)
    llm = make_llm(base, adapters, quantization="int8")
    prompts, names = mixed_batch(72)
    assert_matches_peft(oracle, prompts[:8], names[:8], llm.generate(prompts[:8], SAMPLING, adapters=names[:8]))


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_peft_tokens(checkpoint, adapters, method):
    """Greedy speculation is lossless: the draft (the model itself) proposes, the target verifies."""
    arch, base = checkpoint
    oracle = Oracle(base, adapters)
    extra = {"speculative_model": str(base)} if method == "draft" else {}
    llm = make_llm(base, adapters, speculative_method=method, num_speculative_tokens=3, **extra)
    prompts, names = mixed_batch(73)
    prompts = [p * 2 for p in prompts[:6]]  # repeats for the n-gram proposer to find
    outputs = llm.generate(prompts, SAMPLING, adapters=names[:6])
    assert_matches_peft(oracle, prompts, names[:6], outputs)
    assert sum(out.usage.spec_accepted_tokens for out in outputs) > 0


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_prefix_cache_hits_past_the_window_match_peft(checkpoint, adapters):
    """A prompt sharing 20 cached tokens (more than the window) with an earlier one of the same adapter reads
    them from the cache: the sliding layers see only the window's part of them, the full layer all."""
    arch, base = checkpoint
    oracle = Oracle(base, adapters)
    llm = make_llm(base, adapters)
    system = random_prompts(74, [20])[0]
    first, second = [system + tail for tail in random_prompts(75, [3, 6])]
    llm.generate([first, first], SAMPLING, adapters=["all8", None])
    prompts, names = [second, second], ["all8", None]
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert [out.usage.cached_tokens for out in outputs] == [20, 20]
    assert_matches_peft(oracle, prompts, names, outputs)
