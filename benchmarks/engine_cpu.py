"""Quilt's engine against transformers + PEFT on CPU: 64 requests over 8 LoRA adapters.

    .venv/bin/python -m benchmarks.engine_cpu [--family llama|qwen3|gemma2|gemma3|phi3] [--rounds 1]
        [--requests 64] [--adapters 8] [--threads N] [--hidden 128 --layers 4] [--device cuda --dtype bfloat16]

Both run in this process on the same random checkpoint and adapters. The baseline is what a PEFT
user would write: one PeftModel holding every adapter, and for each adapter one batched
`generate` over its requests (left-padded), with min/max new tokens forcing every request's
output length. Prints output tokens per second of each and the ratio of wall times, and the ratio of the
CPU seconds this process spent in each (time.process_time: what the load of other processes inflates least);
with --rounds N the two alternate N times, each going first in every other round, and the best of each is kept
(other processes only ever slow a run). Each side is warmed up by a short generation before it is timed.
"""

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine import LLM, SamplingParams

VOCAB = 1024
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's checkpoint fuses q/k/v and gate/up
WINDOW = 64  # the sliding window of the families that have one: most prompts and outputs outgrow it
FAMILIES = {  # name -> (config class, model class, what the family's config sets beyond the common shape)
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "tie_word_embeddings": True}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 32, "query_pre_attn_scalar": 32,
                                                 "sliding_window": WINDOW}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 32, "query_pre_attn_scalar": 32,
                                                     "sliding_window": WINDOW, "sliding_window_pattern": 2}),
    # Phi-4-mini's shape of rope: a partial rotary (0.75 of head_dim 32: 12 frequencies) with LongRoPE factors,
    # the long ones for sequences past 128 tokens
    "phi3": (Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.75, "pad_token_id": 0, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0 + i / 12 for i in range(12)],
        "long_factor": [2.0 + i / 6 for i in range(12)], "original_max_position_embeddings": 128}}),
}


def build(root: Path, family: str, num_adapters: int, hidden: int, layers: int) -> tuple[Path, dict[str, Path]]:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
        vocab_size=VOCAB, max_position_embeddings=1024, initializer_range=0.1, **extra,
    )
    torch.manual_seed(0)
    model_cls(config).save_pretrained(root / "base")
    adapter_dirs = {}
    for i in range(num_adapters):
        base = AutoModelForCausalLM.from_pretrained(root / "base")
        targets = FUSED_TARGETS[: 1 + i % 4] if family == "phi3" else TARGETS[: 2 + i % 6]
        lora = LoraConfig(r=[8, 16, 32, 64][i % 4], lora_alpha=16, target_modules=targets)
        model = get_peft_model(base, lora)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(root / f"adapter{i}")
        adapter_dirs[f"adapter{i}"] = root / f"adapter{i}"
    return root / "base", adapter_dirs


def workload(num_requests: int, names: list[str], seed: int = 0):
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 160))]
        requests.append((names[i % len(names)], prompt, rng.randint(16, 96)))
    return requests


def run_engine(base: Path, adapter_dirs: dict[str, Path], requests, device: str, dtype: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of generating every request."""
    llm = LLM(base, device=device, dtype=dtype, pool_adapters_at_max_rank=len(adapter_dirs), max_adapter_rank=64, block_size=16,
              max_num_batched_tokens=2048, max_num_seqs=len(requests))
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    llm.generate([requests[0][1]], SamplingParams(max_tokens=2), adapters=[requests[0][0]])  # warm up
    sampling = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, _, n in requests]
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([p for _, p, _ in requests], sampling, adapters=[name for name, _, _ in requests])
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    assert [len(o.token_ids) for o in outputs] == [n for _, _, n in requests]
    return elapsed


@torch.inference_mode()
def run_peft(base: Path, adapter_dirs: dict[str, Path], requests, device: str, dtype: str) -> tuple[float, float]:
    model = None
    for name, path in adapter_dirs.items():
        if model is None:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    prompt = torch.tensor([requests[0][1]], device=device)
    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)  # warm up, as the engine is
    start, cpu = time.perf_counter(), time.process_time()
    for name in adapter_dirs:
        group = [(p, n) for adapter, p, n in requests if adapter == name]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=device)
        new = max(n for _, n in group)  # batched: every row runs as long as the longest
        model.set_adapter(name)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=list(FAMILIES), default="llama")
    parser.add_argument("--rounds", type=int, default=1, help="engine and PEFT runs, alternated; the best kept")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter_dirs = build(Path(tmp), args.family, args.adapters, args.hidden, args.layers)
        requests = workload(args.requests, list(adapter_dirs))
        output_tokens = sum(n for _, _, n in requests)
        rounds = []
        for i in range(args.rounds):
            peft = run_peft(base, adapter_dirs, requests, args.device, args.dtype) if i % 2 else None
            engine = run_engine(base, adapter_dirs, requests, args.device, args.dtype)
            rounds.append((engine, peft or run_peft(base, adapter_dirs, requests, args.device, args.dtype)))
        engine_s, peft_s = min(e[0] for e, _ in rounds), min(p[0] for _, p in rounds)
        engine_cpu, peft_cpu = min(e[1] for e, _ in rounds), min(p[1] for _, p in rounds)
    window = f", window {WINDOW}" if "sliding_window" in FAMILIES[args.family][2] else ""
    print(f"{args.family} hidden {args.hidden}{window}, {args.layers} layers, vocab {VOCAB}; {args.requests} requests over "
          f"{args.adapters} adapters (ranks 8-64), {output_tokens} output tokens; {args.device} {args.dtype}, "
          f"torch threads {torch.get_num_threads()}; load average {load_before:.2f} -> {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(f"quilt engine        {output_tokens / engine_s:9.1f} tokens/s  ({engine_s:.2f} s, CPU {engine_cpu:.2f} s)")
    print(f"transformers + PEFT {output_tokens / peft_s:9.1f} tokens/s  ({peft_s:.2f} s, CPU {peft_cpu:.2f} s)")
    print(f"ratio               {peft_s / engine_s:9.2f}x  (CPU seconds: {peft_cpu / engine_cpu:.2f}x)")
    if args.rounds > 1:
        print("rounds (engine / PEFT, wall s and CPU s): "
              + ", ".join(f"{e[0]:.2f} / {p[0]:.2f} ({e[1]:.2f} / {p[1]:.2f})" for e, p in rounds))


if __name__ == "__main__":
    main()
