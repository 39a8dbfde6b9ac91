"""Tensor parallelism: per step, compute against communication, at each tensor-parallel size, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.tensor_parallel [--tp 1 2] [--requests 16]
        [--hidden 512 --layers 4] [--device cuda --dtype bfloat16] [--smoke]

The same random Llama and LoRA adapters (ranks 8-32, every projection) run the same workload at each size, one
after the other in this process (rank 0) and its workers. Every step is timed on rank 0 (step wall time, the
pickled step input sent to the workers, and the all-reduces, each timed on its own; on CUDA with a
synchronize around each); compute is the rest. An all-reduce's time includes waiting for the slowest rank to
arrive. Printed: per-step means over prefill steps and decode steps, and the ratio to tp=1. On a multi-GPU
machine pass --device cuda (rank r runs on cuda:r, NCCL); the defaults suit CPU.
"""

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

VOCAB = 1024
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(root: Path, *, hidden: int, layers: int, num_adapters: int) -> tuple[Path, list[Path]]:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                         num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(2, hidden // 128),
                         vocab_size=VOCAB, max_position_embeddings=1024, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    paths = []
    for i in range(num_adapters):
        model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                               LoraConfig(r=[8, 16, 32][i % 3], lora_alpha=16, target_modules=TARGETS))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(root / f"adapter{i}")
        paths.append(root / f"adapter{i}")
    return root / "base", paths


@dataclass
class Phase:
    steps: int = 0
    tokens: int = 0
    total: float = 0.0
    all_reduce: float = 0.0
    broadcast: float = 0.0
    calls: int = 0

    def row(self, name: str, tp: int, base: "Phase | None") -> str:
        n = max(self.steps, 1)
        total, reduce_, send = self.total / n * 1e3, self.all_reduce / n * 1e3, self.broadcast / n * 1e3
        compute = total - reduce_ - send
        ratio = f"{total / (base.total / max(base.steps, 1) * 1e3):.2f}x" if base and base.steps else "-"
        return (f"| {tp} | {name} | {self.steps} | {self.tokens / n:.0f} | {total:.2f} | {compute:.2f} | "
                f"{reduce_:.2f} ({self.calls / n:.0f}) | {send:.2f} | {100 * (reduce_ + send) / max(total, 1e-9):.0f}% "
                f"| {ratio} |")


@dataclass
class Result:
    phases: dict[str, Phase] = field(default_factory=lambda: {"prefill": Phase(), "decode": Phase()})
    tokens: list[list[int]] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    probes: dict[str, float] = field(default_factory=dict)  # phase -> seconds of one bare all-reduce of its size


def run(base: Path, adapters: list[Path], *, tp: int, requests: list, device: str, dtype: str) -> Result:
    engine = LLMEngine(EngineConfig(model=str(base), device=device, dtype=dtype, block_size=16,
                                    max_adapter_rank=32, max_num_seqs=len(requests), max_num_batched_tokens=1024,
                                    tensor_parallel_size=tp), time_collectives=True)
    try:
        digests = [engine.add_adapter(path) for path in adapters]
        seen: dict[str, object] = {}
        engine.runner.model.register_forward_pre_hook(
            lambda module, args: seen.update(tokens=args[0].shape[0], decode=args[1].is_decode))
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for i, digest in enumerate(digests):  # places every adapter before the measured run
            engine.add_request(f"warm{i}", requests[0][1][:8], warm, adapter=digest)
        while engine.has_unfinished():
            engine.step()
        result = Result()
        for i, (adapter, prompt, new) in enumerate(requests):
            sampling = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            engine.add_request(str(i), prompt, sampling, adapter=digests[adapter] if adapter is not None else None)
        tokens: dict[str, list[int]] = {}
        workers_before = engine.workers.stats() if engine.workers else []
        while engine.has_unfinished():
            comm, send, calls = engine.comm.seconds, _broadcast(engine), engine.comm.calls
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            phase = result.phases["decode" if seen.get("decode") else "prefill"]
            phase.steps += 1
            phase.tokens += seen.get("tokens", 0)
            phase.total += elapsed
            phase.all_reduce += engine.comm.seconds - comm
            phase.broadcast += _broadcast(engine) - send
            phase.calls += engine.comm.calls - calls
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if engine.workers:
            after = engine.workers.stats()
            result.workers = [{k: a[k] - b[k] for k in ("steps", "step_seconds", "comm_seconds")}
                              for a, b in zip(after, workers_before, strict=True)]
        result.tokens = [tokens[str(i)] for i in range(len(requests))]
        if engine.workers:
            dtype = engine.memory.layers[0].dtype
            for name, phase in result.phases.items():
                if phase.steps:
                    shape = (max(1, phase.tokens // phase.steps), engine.runner.model.spec.hidden_size)
                    result.probes[name] = engine.workers.probe(engine.comm, shape, dtype, count=50)
        return result
    finally:
        engine.shutdown()


def _broadcast(engine: LLMEngine) -> float:
    return engine.workers.broadcast_seconds if engine.workers else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.requests, args.adapters = 128, 2, 4, 1
    if args.device.startswith("cuda") and max(args.tp) > torch.cuda.device_count():
        parser.error(f"--tp {max(args.tp)} needs that many GPUs; this machine has {torch.cuda.device_count()}")
    rng = random.Random(0)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(Path(tmp), hidden=args.hidden, layers=args.layers, num_adapters=args.adapters)
        new_tokens = (2, 4) if args.smoke else (16, 32)
        requests = [(None if i % 4 == 3 else i % args.adapters,
                     [rng.randrange(3, VOCAB) for _ in range(rng.randint(32, 96))], rng.randint(*new_tokens))
                    for i in range(args.requests)]
        results = {tp: run(base, adapters, tp=tp, requests=requests, device=args.device, dtype=args.dtype)
                   for tp in args.tp}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}; {args.requests} requests (3 in 4 "
          f"with one of {args.adapters} adapters of ranks 8-32 on every projection); {args.device} {args.dtype}, "
          f"torch threads {torch.get_num_threads()} per rank; load average {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("| tp | phase | steps | tokens/step | step ms | compute ms | all-reduce ms (calls) | broadcast ms | "
          "comm share | step vs tp=1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = results[args.tp[0]]
    for tp, result in results.items():
        for name in ("prefill", "decode"):
            base = first.phases[name] if args.tp[0] == 1 else None
            print(result.phases[name].row(name, tp, base))
    for tp, result in results.items():
        for name, seconds in result.probes.items():
            phase = result.phases[name]
            print(f"tp={tp} {name}: one all-reduce of [{phase.tokens // max(phase.steps, 1)}, {args.hidden}] alone "
                  f"(ranks idle, back to back) {seconds * 1e3:.3f} ms; in the steps "
                  f"{phase.all_reduce / max(phase.calls, 1) * 1e3:.3f} ms (the rest is waiting for the slower rank)")
        for rank, w in enumerate(result.workers, start=1):
            print(f"tp={tp} rank {rank}: {w['steps']} steps, {w['step_seconds'] / max(w['steps'], 1) * 1e3:.2f} ms "
                  f"per step of which all-reduce {w['comm_seconds'] / max(w['steps'], 1) * 1e3:.2f} ms")
    same = all(r.tokens == first.tokens for r in results.values())
    print(f"greedy tokens identical across sizes: {'yes' if same else 'NO'}")
    if not same and args.dtype == "float32":  # in 16-bit the sums' order may flip a close argmax
        raise SystemExit(1)


if __name__ == "__main__":
    main()
