"""Quilt's engine against transformers + PEFT on an MoE base (Qwen3-MoE or Mixtral shape) on CPU: a mixed batch of
requests over LoRA adapters on attention and on the experts, and where the engine's step time goes.

    .venv/bin/python -m benchmarks.moe [--family qwen3-moe|mixtral] [--rounds 1] [--requests 32] [--adapters 4]
        [--expert-adapters 2] [--experts 8 --top-k 2] [--hidden 128 --layers 4] [--threads N]

Both run in this process on the same random checkpoint and adapters, the baseline as in benchmarks/engine_cpu.py
(one PeftModel, one batched generate per adapter). Adapter i adapts attention (ranks 8-64); the last
--expert-adapters of them also adapt every expert's gate_up and down (PEFT target_parameters, rank 8 or 16 per
expert). Prints the ratio of wall and CPU times, then a third engine run with routing (softmax + top-k + the sort
by expert), the grouped expert matmuls (kernels.grouped_matmul), the attention LoRA kernels (shrink + expand) and
the experts' LoRA (kernels.expert_lora) timed, as shares of that run's wall time (the timers add a little).
"""

import argparse
import os
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import kernels
from benchmarks.engine_cpu import VOCAB, run_engine, run_peft, workload
from engine.models import moe

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build(root: Path, family: str, args) -> tuple[Path, dict[str, Path]]:
    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                 num_key_value_heads=max(1, args.hidden // 64), vocab_size=VOCAB, max_position_embeddings=1024,
                 initializer_range=0.1, num_experts_per_tok=args.top_k)
    if family == "qwen3-moe":
        config = Qwen3MoeConfig(**shape, head_dim=32, num_experts=args.experts, moe_intermediate_size=args.hidden,
                                intermediate_size=args.hidden * 3, norm_topk_prob=True)
        model_cls = Qwen3MoeForCausalLM
    else:
        config = MixtralConfig(**shape, num_local_experts=args.experts, intermediate_size=args.hidden)
        model_cls = MixtralForCausalLM
    torch.manual_seed(0)
    model_cls(config).save_pretrained(root / "base")
    adapter_dirs = {}
    for i in range(args.adapters):
        experts = i >= args.adapters - args.expert_adapters
        lora = LoraConfig(r=[8, 16, 32, 64][i % 4], lora_alpha=16, target_modules=ATTENTION[: 2 + i % 3],
                          target_parameters=EXPERTS if experts else None,
                          rank_pattern={"gate_up_proj": 8 + 8 * (i % 2), "down_proj": 8 + 8 * (i % 2)})
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"), lora)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(root / f"adapter{i}")
        adapter_dirs[f"adapter{i}"] = root / f"adapter{i}"
    return root / "base", adapter_dirs


def step_split(base: Path, adapter_dirs: dict[str, Path], requests) -> tuple[float, dict[str, float]]:
    """(wall seconds, seconds per part) of one more engine run with its MoE and LoRA ops timed."""
    spent: dict[str, float] = defaultdict(float)

    def timed(part, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += time.perf_counter() - start
        return wrapper

    saved = {(moe, "route"): moe.route, (moe, "sort_by_expert"): moe.sort_by_expert,
             (kernels, "grouped_matmul"): kernels.grouped_matmul, (kernels, "lora_shrink"): kernels.lora_shrink,
             (kernels, "lora_expand"): kernels.lora_expand, (kernels, "expert_lora"): kernels.expert_lora}
    parts = {"route": "routing", "sort_by_expert": "routing", "grouped_matmul": "grouped expert matmuls",
             "lora_shrink": "attention LoRA", "lora_expand": "attention LoRA", "expert_lora": "expert LoRA"}
    for (module, name), fn in saved.items():
        setattr(module, name, timed(parts[name], fn))
    try:
        wall, _ = run_engine(base, adapter_dirs, requests, "cpu", "float32")
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    return wall, dict(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3-moe", "mixtral"], default="qwen3-moe")
    parser.add_argument("--rounds", type=int, default=1, help="engine and PEFT runs, alternated; the best kept")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--expert-adapters", type=int, default=2, help="of the adapters, how many adapt the experts")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter_dirs = build(Path(tmp), args.family, args)
        requests = workload(args.requests, list(adapter_dirs))
        output_tokens = sum(n for _, _, n in requests)
        rounds = []
        for _ in range(args.rounds):
            engine = run_engine(base, adapter_dirs, requests, "cpu", "float32")
            rounds.append((engine, run_peft(base, adapter_dirs, requests, "cpu", "float32")))
        split_wall, split = step_split(base, adapter_dirs, requests)
    engine_s, peft_s = min(e[0] for e, _ in rounds), min(p[0] for _, p in rounds)
    engine_cpu, peft_cpu = min(e[1] for e, _ in rounds), min(p[1] for _, p in rounds)
    print(f"{args.family} hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, vocab "
          f"{VOCAB}; {args.requests} requests over {args.adapters} attention adapters (ranks 8-64), "
          f"{args.expert_adapters} of them on the experts too (rank 8/16 per expert), {output_tokens} "
          f"output tokens; cpu float32, torch threads {torch.get_num_threads()}; load average {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"quilt engine        {output_tokens / engine_s:9.1f} tokens/s  ({engine_s:.2f} s, CPU {engine_cpu:.2f} s)")
    print(f"transformers + PEFT {output_tokens / peft_s:9.1f} tokens/s  ({peft_s:.2f} s, CPU {peft_cpu:.2f} s)")
    print(f"ratio               {peft_s / engine_s:9.2f}x  (CPU seconds: {peft_cpu / engine_cpu:.2f}x)")
    shares = ", ".join(f"{part} {seconds / split_wall:.0%}" for part, seconds in sorted(split.items()))
    print(f"engine step time ({split_wall:.2f} s timed run): {shares}, the rest {1 - sum(split.values()) / split_wall:.0%}")


if __name__ == "__main__":
    main()
