"""Quilt's engine on a Llama-3-8B-shaped model with many LoRA adapters, side by side in one run.

    python benchmarks/gpu_trace.py --json trace.json            # on a CUDA GPU (docs/gpu.md)
    python benchmarks/gpu_trace.py --tiny                       # CPU, tiny model: checks the wiring only

Random bf16 weights of the Llama-3-8B shape are written as a local checkpoint and random rank-16
adapters on all seven projections as canonical adapter folders (benchmarks/llama_shape.py). A trace
of requests (prompts 128-1024, outputs 64-512 tokens) draws its adapters from a power law over a
population of 1,000; only the adapters it draws are written. Then, each in its own process so that
its GPU memory goes with it:
  trace_peft.py    transformers + PEFT on the first groups of the trace, for a bounded time;
  trace_engine.py  one engine: decode at batch 64 with and without adapters, adapter cold starts,
                   the PEFT subset, the whole trace with and without adapters.
The table printed last holds the engine's GPU goals:
  (1) decode throughput with many distinct adapters / the same engine with no LoRA (goal >= 0.90);
  (2) throughput / transformers + PEFT on the same requests (goal >= 30x);
  (3) a decode step at batch 64 / the HBM roofline: bytes of weights + KV + adapter rows used over the
      copy bandwidth measured in the same run (goal >= 0.70);
  (4) adapter cold start host -> device (goal <= 5 ms) and disk -> device (<= 150 ms), TTFT cold / warm.
--budget-s bounds the whole run: a phase that runs out of time is killed and the table shows what it
had measured. Nothing here asserts a speed; figures go to benchmarks/RESULTS.md with the command.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository before benchmarks/ (its kernels.py is no package)

import llama_shape  # noqa: E402
from work_folder import work_folder  # noqa: E402

FULL = {
    "requests": 256, "population": 1000, "zipf": 1.0, "rank": 16, "prompt_min": 128, "prompt_max": 1024,
    "output_min": 64, "output_max": 512, "batch": 64, "decode_steps": 32, "max_num_seqs": 128,
    "max_num_batched_tokens": 2048, "block_size": 16, "peft_seconds": 60.0, "peft_max_groups": 12, "cold": 4,
    "cold_prompt": 512, "reference_tokens": 16, "profile_steps": 8, "budget_s": 480.0,
}  # fmt: skip
TINY = {
    **FULL, "requests": 24, "population": 50, "prompt_min": 16, "prompt_max": 64, "output_min": 8, "output_max": 32,
    "batch": 8, "decode_steps": 6, "max_num_seqs": 16, "max_num_batched_tokens": 256, "peft_seconds": 3.0,
    "peft_max_groups": 3, "cold": 2, "cold_prompt": 32, "reference_tokens": 8, "profile_steps": 3, "budget_s": 120.0,
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model on CPU: checks the wiring, figures mean nothing"
    )
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument(
        "--workdir", type=Path, help="where the checkpoint and adapters go (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (to fit a time budget)")
    for name, value in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)
    shape = llama_shape.TINY if args.tiny else llama_shape.LLAMA3_8B
    if args.layers:
        shape = llama_shape.Shape(
            **{**asdict(shape), "layers": args.layers, "name": f"{shape.name}-{args.layers}L"}
        )
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "environment": environment(device),
    }
    with work_folder("quilt-gpu-trace-", path=args.workdir, keep=args.keep) as work:  # 8B: 16 GB of weights
        print(f"gpu_trace: {shape.name} on {report['environment']['device']}, work in {work}", flush=True)
        plan = make_plan(args, shape, device, dtype, work)
        if device == "cuda":
            torch.cuda.empty_cache()  # the phases need the memory this process drew the weights in
        report["setup"] = plan["setup"]
        print(f"checkpoint {plan['setup']['checkpoint']['bytes'] / 1e9:.1f} GB in "
              f"{plan['setup']['checkpoint']['seconds']:.1f} s; {len(plan['adapters'])} adapters in "
              f"{plan['setup']['adapters_s']:.1f} s", flush=True)  # fmt: skip
        remaining = deadline - time.monotonic()
        if not args.skip_peft:
            report["peft"] = run_phase(
                "trace_peft.py", work, min(remaining * 0.4, args.peft_seconds * 2 + 120)
            )
        report["engine"] = run_phase("trace_engine.py", work, deadline - time.monotonic() - 5)
    report["args"] = vars(args) | {"json": str(args.json) if args.json else None,
                                   "workdir": str(args.workdir) if args.workdir else None}  # fmt: skip
    report["trace_summary"] = plan["trace_summary"]
    report["seconds"] = time.monotonic() - started
    lines = table(report, shape, args)
    report["table"] = lines
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    return 0 if report["engine"].get("rc") == 0 and report.get("peft", {}).get("rc", 0) == 0 else 1


def environment(device: str) -> dict:
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU (tiny model; figures meaningless)",
           "python": sys.version.split()[0], "torch": torch.__version__,
           "dtype": "bfloat16" if device == "cuda" else "float32"}  # fmt: skip
    for package in ("triton", "transformers", "peft"):
        try:
            env[package] = __import__(package).__version__
        except ImportError:
            env[package] = None
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def make_plan(args, shape, device: str, dtype: torch.dtype, work: Path) -> dict:
    """Checkpoint, trace, adapters; everything the phases need goes into work/plan.json."""
    checkpoint = llama_shape.write_checkpoint(work / "base", shape, dtype=dtype, device=device)
    trace = llama_shape.make_trace(
        args.requests, population=args.population, zipf=args.zipf, prompt_range=(args.prompt_min, args.prompt_max),
        output_range=(args.output_min, args.output_max), vocab=shape.vocab, seed=0,
    )  # fmt: skip
    used = list(dict.fromkeys(r.adapter for r in trace))  # in order of first use
    decode_ids = (
        used[: args.batch]
        + [i for i in range(args.population) if i not in used][: max(0, args.batch - len(used))]
    )
    decode = llama_shape.make_trace(args.batch, population=1, zipf=1.0, prompt_range=(args.prompt_min, args.prompt_max),
                                    output_range=(1, 1), vocab=shape.vocab, seed=1)  # fmt: skip
    for request, adapter in zip(decode, decode_ids, strict=True):
        request.adapter = adapter
    served = sorted(set(used) | set(decode_ids))
    spare = [i for i in reversed(range(args.population)) if i not in served]
    cold = {"disk": spare[: args.cold], "host": spare[args.cold : 2 * args.cold]}
    written, adapters_s = llama_shape.write_adapters(work / "adapters", shape, served + cold["disk"] + cold["host"],
                                                     rank=args.rank, dtype=dtype, device=device)  # fmt: skip
    itemsize = torch.tensor([], dtype=dtype).element_size()
    one = llama_shape.adapter_bytes(shape, args.rank, itemsize)
    prompt_steps = -(-sum(len(r.prompt) for r in decode) // args.max_num_batched_tokens)
    reference = [{"prompt": r.prompt[: args.prompt_min], "adapter": a, "max_tokens": args.reference_tokens}
                 for r, a in zip(trace[-4:], [*used[:3], None], strict=False)]  # fmt: skip
    plan = {
        "args": {k: v for k, v in vars(args).items() if k in FULL}, "device": device,
        "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape), "checkpoint": str(work / "base"),
        "trace": llama_shape.trace_to_json(trace), "decode": llama_shape.trace_to_json(decode), "reference": reference,
        "decode_max_tokens": args.decode_steps + 2 * prompt_steps + 16, "served": served, "cold_adapters": cold,
        "adapters": {str(i): {"path": p, "digest": d} for i, (p, d) in written.items()},
        "host_cache_bytes": int((len(written) + 4) * one * 1.25) + (64 << 20),
        "setup": {"checkpoint": checkpoint, "adapters_s": adapters_s, "adapters_written": len(written),
                  "adapter_bytes": one},
        "trace_summary": {"requests": len(trace), "distinct_adapters": len(used), "population": args.population,
                          "prompt_tokens": sum(len(r.prompt) for r in trace),
                          "output_tokens": sum(r.max_tokens for r in trace),
                          "top_adapter_share": max(sum(r.adapter == a for r in trace) for a in used) / len(trace),
                          "longest_output_by_adapter": {str(a): max(r.max_tokens for r in trace if r.adapter == a)
                                                        for a in used}},
    }  # fmt: skip
    (work / "plan.json").write_text(json.dumps(plan))
    return plan


def run_phase(script: str, work: Path, timeout: float) -> dict:
    """Run one phase in its own process; returns what it wrote (possibly partial) plus rc and seconds."""
    name = script.removesuffix(".py").removeprefix("trace_")
    out = work / f"{name}.json"
    print(f"--- {name} (up to {timeout:.0f} s)", flush=True)
    start = time.monotonic()
    try:
        deadline = str(time.time() + timeout - 10)  # the phase may stop itself before it is killed
        rc: int | str = subprocess.run(
            [sys.executable, str(HERE / script), str(work), deadline], timeout=max(timeout, 1)
        ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(rc=rc, seconds=time.monotonic() - start)
    print(f"--- {name}: rc {rc} after {result['seconds']:.0f} s", flush=True)
    return result


def table(report: dict, shape, args) -> list[str]:
    engine, peft, env = report.get("engine", {}), report.get("peft", {}), report["environment"]
    summary = report["trace_summary"]
    lines = [
        f"## gpu_trace: {shape.name}, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, peft {env['peft']}, commit {env['commit']}",
        f"trace: {summary['requests']} requests, {summary['distinct_adapters']} distinct adapters drawn from "
        f"{summary['population']} (zipf {args.zipf}; top adapter {100 * summary['top_adapter_share']:.0f}% of "
        f"requests), {summary['prompt_tokens']} prompt + {summary['output_tokens']} output tokens; rank {args.rank}",
        "| # | measure | quilt | baseline | ratio | goal |", "|---|---|---:|---:|---:|---|",
    ]  # fmt: skip
    correct = engine.get("correctness")
    if correct:
        lines.append(f"| C | {report['environment']['dtype']} log-prob of PEFT's greedy tokens ({correct['sequences']} "
                     f"sequences, {correct['positions']} positions): max / mean abs diff; top-1 differs at "
                     f"{correct['top1_differs_decisive']} of {correct['decisive_positions']} positions with top-2 gap "
                     f"> 0.1 ({correct['top1_differs']} overall) | {correct['max_abs_logprob_diff']:.4f} | "
                     f"{correct['mean_abs_logprob_diff']:.4f} | | <= 0.05, 0 differ |")  # fmt: skip
    trace = engine.get("trace", {})
    if "lora" in trace and "base" in trace:
        lora, base = trace["lora"], trace["base"]
        lines.append(f"| 1a | trace output tok/s, {lora['distinct_adapters']} adapters vs no LoRA | "
                     f"{lora['output_tokens_per_s']:.0f} | {base['output_tokens_per_s']:.0f} | "
                     f"{lora['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} | >= 0.90 |")  # fmt: skip
    decode = engine.get("decode", {})
    if decode.get("lora", {}).get("steps") and decode.get("base", {}).get("steps"):
        lora, base = decode["lora"], decode["base"]
        lines.append(f"| 1b | decode tok/s at batch {lora['batch']}, {lora['adapters']} distinct adapters vs none | "
                     f"{lora['tokens_per_s']:.0f} | {base['tokens_per_s']:.0f} | "
                     f"{lora['tokens_per_s'] / base['tokens_per_s']:.2f} | >= 0.90 |")  # fmt: skip
    groups = peft.get("groups", [])
    if groups and "subset" in engine:
        peft_tokens, peft_s = sum(g["tokens"] for g in groups), sum(g["seconds"] for g in groups)
        sub = engine["subset"]
        lines.append(f"| 2 | tok/s on the {sub['requests']} requests PEFT ran ({len(groups)} adapters) | "
                     f"{sub['output_tokens_per_s']:.0f} | {peft_tokens / peft_s:.1f} | "
                     f"{sub['output_tokens_per_s'] / (peft_tokens / peft_s):.1f}x | >= 30x |")  # fmt: skip
        if "lora" in trace:
            estimate = peft_estimate(report)
            lines.append(f"| 2' | whole trace tok/s vs PEFT scaled from {len(groups)} groups (estimate) | "
                         f"{trace['lora']['output_tokens_per_s']:.0f} | {estimate:.1f} | "
                         f"{trace['lora']['output_tokens_per_s'] / estimate:.1f}x | >= 30x |")  # fmt: skip
    for tag, label in (("lora", "with adapters"), ("base", "no LoRA")):
        d = decode.get(tag, {})
        if d.get("steps"):
            lines.append(f"| 3 | decode step ms at batch {d['batch']} {label} (roofline: "
                         f"{(d['bytes']['weights'] + d['bytes']['kv_p50'] + d['bytes']['adapters']) / 1e9:.1f} GB at "
                         f"{engine['copy_bandwidth'] / 1e9:.0f} GB/s) | {d['step_ms_p50']:.2f} | "
                         f"{d['roofline_ms_p50']:.2f} | {d['roofline_ratio_p50']:.2f} | >= 0.70 |")  # fmt: skip
    cold = engine.get("cold", {})
    for kind, goal in (("host", "<= 5 ms"), ("disk", "<= 150 ms")):
        rows = cold.get(kind, [])
        if rows:
            c = statistics.median(r["ttft_cold_ms"] for r in rows)
            w = statistics.median(r["ttft_warm_ms"] for r in rows)
            where = f", files on {cold.get('filesystem')}" if kind == "disk" else ""
            lines.append(f"| 4 | {kind} -> device: TTFT cold - warm, ms ({cold['prompt_tokens']}-token prompt{where}, "
                         f"median of {len(rows)}; cold/warm {c / w:.2f}) | {c - w:.1f} | {w:.1f} | {c / w:.2f} | "
                         f"{goal} |")  # fmt: skip
    host = cold.get("host", [])
    if host:
        lines.append(f"| 4 | disk -> host (add_adapter: read, check, digest), ms | "
                     f"{statistics.median(r['disk_to_host_ms'] for r in host):.1f} | | | |")  # fmt: skip
    if "raw_copy_ms" in cold:
        raw = cold["raw_copy_ms"]
        lines.append(f"| 4 | one adapter ({report['setup']['adapter_bytes'] / 1e6:.0f} MB) host -> device by torch "
                     f"alone: pinned / pageable ms | {raw['pinned']:.2f} | {raw['pageable']:.2f} | | |")  # fmt: skip
    setup = report["setup"]
    lines.append(f"setup: checkpoint {setup['checkpoint']['bytes'] / 1e9:.1f} GB written in "
                 f"{setup['checkpoint']['seconds']:.1f} s; {setup['adapters_written']} adapters "
                 f"({setup['adapter_bytes'] / 1e6:.0f} MB each) in {setup['adapters_s']:.1f} s; engine load "
                 f"{engine.get('load_s', float('nan')):.1f} s, add_adapter x{engine.get('add_adapters_n', 0)} "
                 f"{engine.get('add_adapters_s', float('nan')):.1f} s; phases: peft rc {peft.get('rc', '-')} "
                 f"{peft.get('seconds', 0):.0f} s, engine rc {engine.get('rc')} {engine.get('seconds', 0):.0f} s; "
                 f"total {report['seconds']:.0f} s")  # fmt: skip
    prof = engine.get("profile")
    if prof and prof.get("device_busy_fraction") is not None:
        lines.append(f"profile: {prof['steps']} decode steps with adapters under torch.profiler: device kernels busy "
                     f"{100 * prof['device_busy_fraction']:.0f}% of the wall time (table in trace.log / trace.json)")  # fmt: skip
    elif prof:
        lines.append(f"profile: {prof['steps']} decode steps with adapters under torch.profiler (no device here: "
                     "no busy share; table in trace.log)")
    for name, text in engine.get("errors", {}).items():
        lines.append(f"FAILED experiment {name}: {text.strip().splitlines()[-1]} (traceback in trace.json)")
    if engine.get("config_dropped"):
        lines.append(
            f"note: this engine's EngineConfig has no {', '.join(engine['config_dropped'])} (left out)"
        )
    for tag in ("subset", "trace"):
        runs = [engine[tag]] if tag == "subset" and tag in engine else list(engine.get(tag, {}).values())
        for run in runs:
            if isinstance(run, str):
                lines.append(f"NOTE {tag}: {run}")
                continue
            if run.get("errors") or run.get("wrong_length"):
                lines.append(f"WARNING {tag}: errors {run['errors']} wrong lengths {run['wrong_length']}")
    if report["environment"]["device"].startswith("CPU"):
        lines.append("(CPU, tiny model: this run checks the wiring; none of these figures means anything)")
    return lines


def peft_estimate(report: dict) -> float:
    """PEFT tokens/s over the whole trace: measured groups as measured, every other group as its longest
    output times the median seconds per generated position of the measured groups."""
    groups = report["peft"]["groups"]
    per_position = statistics.median(g["seconds"] / g["max_new"] for g in groups)
    measured = {str(g["adapter"]) for g in groups}
    longest = report["trace_summary"]["longest_output_by_adapter"]
    seconds = sum(g["seconds"] for g in groups) + sum(
        n * per_position for a, n in longest.items() if a not in measured
    )
    return report["trace_summary"]["output_tokens"] / seconds


if __name__ == "__main__":
    sys.exit(main())
