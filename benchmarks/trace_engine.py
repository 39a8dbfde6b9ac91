"""The engine side of benchmarks/gpu_trace.py, in its own process, through the engine's public API only.

    python benchmarks/trace_engine.py WORKDIR [DEADLINE]  # reads WORKDIR/plan.json (+ peft.json), writes engine.json

One LLMEngine serves every experiment, cheapest first, and engine.json is rewritten after each, so a
run cut short still reports what it measured:
  correctness  the tokens transformers + PEFT chose greedily (peft.json "reference") scored by the
             engine as a prompt (prompt_logprobs): each token's log-probability against PEFT's, and
             whether the engine's top token is PEFT's where PEFT's top-2 gap exceeds 0.1;
  decode     a batch of `batch` requests with distinct adapters, then the same with none: the time of
             each step once every request is past its prompt (pure decode steps), and the bytes such
             a step must move (weights + KV + adapter rows) over the copy bandwidth measured here;
  cold       TTFT of a request whose adapter is only on disk (page cache dropped for its files) or
             only in host memory, then of a second request on the same adapter (warm);
  subset     the requests transformers + PEFT ran (trace_peft.py), all submitted at once;
  trace      the whole trace without adapters, then with them (power law over the population); the
             second is left out if, at the pace of the first, it would end after DEADLINE (epoch seconds);
  profile    right after decode, if a minute is left: torch.profiler over decode steps at batch `batch` with
             adapters (its table goes to stdout; the share of wall time the GPU is busy to the summary).
At the end: the memory the engine used.
"""

import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# the repository goes before benchmarks/ (this script's folder), whose kernels.py would hide the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_shape  # noqa: E402
import trace_cold  # noqa: E402

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

TENANT = "bench"


def main(work: Path, deadline: float) -> None:
    plan = json.loads((work / "plan.json").read_text())
    args, device = plan["args"], plan["device"]
    if device == "cpu":
        torch.set_num_threads(1)
    shape = llama_shape.Shape(**plan["shape"])
    itemsize = torch.tensor([], dtype=getattr(torch, plan["dtype"])).element_size()
    result: dict = {}

    def save() -> None:
        (work / "engine.json").write_text(json.dumps(result))

    result["copy_bandwidth"] = copy_bandwidth(device)
    start = time.perf_counter()
    config, dropped = engine_config(plan)
    engine = LLMEngine(config)
    result.update(load_s=time.perf_counter() - start, config=plan_config(config), config_dropped=dropped)
    start = time.perf_counter()
    digests = {}
    for adapter_id in plan["served"]:
        digests[adapter_id] = engine.add_adapter(plan["adapters"][str(adapter_id)]["path"])
    result["add_adapters_s"] = time.perf_counter() - start
    result["add_adapters_n"] = len(digests)
    save()
    trace = llama_shape.trace_from_json(plan["trace"])
    warm = dataclasses.replace(trace[0], prompt=trace[0].prompt[:16], max_tokens=2)
    run_requests(engine, [warm], digests, "warm-a")  # compiles the kernels
    run_requests(engine, [warm], None, "warm-b")
    peft_file = work / "peft.json"
    peft = json.loads(peft_file.read_text()) if peft_file.exists() else {}
    batch = llama_shape.trace_from_json(plan["decode"])
    subset = [r for r in trace if any(r.index in g["requests"] for g in peft.get("groups", []))]

    def correctness() -> None:
        if peft.get("reference"):
            result["correctness"] = score_reference(engine, peft["reference"], digests)

    def decode() -> None:
        result["decode"] = {}
        for tag, chosen in (("lora", digests), ("base", None)):
            steps = decode_batch(
                engine, batch, chosen, args["decode_steps"], plan["decode_max_tokens"], f"decode-{tag}"
            )
            result["decode"][tag] = summarize_decode(steps, shape, itemsize, args["rank"], result["copy_bandwidth"],
                                                     lora=chosen is not None)  # fmt: skip

    def cold() -> None:
        result["cold"] = trace_cold.cold_start(engine, plan, shape, device, ttft=ttft)

    def same_as_peft() -> None:
        if subset:
            result["subset"] = run_requests(engine, subset, digests, "subset")

    def whole_trace() -> None:
        result["trace"] = {}
        for tag, chosen in (("base", None), ("lora", digests)):
            if (
                "base" in result["trace"]
                and time.time() + 1.2 * result["trace"]["base"]["seconds"] > deadline
            ):
                result["trace"]["skipped"] = f"{tag}: would end after the deadline"
                return
            result["trace"][tag] = run_requests(engine, trace, chosen, f"trace-{tag}")
            save()

    def profile() -> None:
        if args["profile_steps"] and time.time() + 60 < deadline:
            result["profile"] = profile_decode(engine, batch, digests, args["profile_steps"],
                                               plan["decode_max_tokens"], device)  # fmt: skip

    failed = False
    for experiment in (correctness, decode, profile, cold, same_as_peft, whole_trace):  # profile early: cheap
        failed |= not attempt(engine, experiment, result)
        save()
    if device.startswith("cuda"):
        result["cuda_memory"] = {"max_allocated": torch.cuda.max_memory_allocated(),
                                 "max_reserved": torch.cuda.max_memory_reserved(),
                                 "free_total": torch.cuda.mem_get_info()}  # fmt: skip
    if hasattr(engine, "memory_split"):  # the engine-memory branch reports its one pool's split
        result["memory_split"] = engine.memory_split()
    save()
    if failed:
        sys.exit(1)


def attempt(engine: LLMEngine, experiment, result: dict) -> bool:
    """Run one experiment; if it raises, keep the traceback in result["errors"], end whatever requests it
    left in the engine and go on with the next (a benchmark run should report all it can)."""
    try:
        experiment()
        return True
    except Exception:  # any failure of one experiment: recorded, not fatal to the others
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        result.setdefault("errors", {})[experiment.__name__] = text[-4000:]
        for request_id in list(engine.requests):
            engine.abort(request_id)
        _drive(engine)
        return False


def engine_config(plan: dict) -> tuple[EngineConfig, list[str]]:
    """The settings this benchmark wants, keeping only fields this engine's EngineConfig has."""
    args = plan["args"]
    longest = max(args["prompt_max"] + args["output_max"], args["prompt_max"] + plan["decode_max_tokens"]) + 1
    blocks_per_seq = -(-longest // args["block_size"])
    wanted = {
        "model": plan["checkpoint"], "device": plan["device"], "dtype": plan["dtype"],
        "block_size": args["block_size"], "num_kv_blocks": max(args["max_num_seqs"], args["batch"]) * blocks_per_seq,
        "max_num_seqs": max(args["max_num_seqs"], args["batch"]),
        "max_num_batched_tokens": args["max_num_batched_tokens"],
        "max_adapter_rank": args["rank"],
        "host_adapter_cache_bytes": plan["host_cache_bytes"], "enable_prefix_caching": False,
    }  # fmt: skip
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    adapters = max(args["max_num_seqs"], args["batch"])
    # room for as many adapters as the old slots gave, under the name this engine's version has
    if "pool_adapters_at_max_rank" in fields:
        wanted["pool_adapters_at_max_rank"] = adapters
    elif "adapter_memory_bytes" in fields and "max_adapter_slots" not in fields:
        shape, itemsize = llama_shape.Shape(**plan["shape"]), 2 if plan["dtype"] != "float32" else 4
        room = int(adapters * llama_shape.adapter_bytes(shape, args["rank"], itemsize) * 1.3)
        wanted["adapter_memory_bytes"] = room  # row packing wastes up to ~12% of a page chunk on 8B shapes
    else:
        wanted["max_adapter_slots"] = adapters
    return EngineConfig(**{k: v for k, v in wanted.items() if k in fields}), sorted(set(wanted) - fields)


def plan_config(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def copy_bandwidth(device: str) -> float:
    """Bytes per second (read + write) of a large device-to-device copy: the median of 20 after warm-up."""
    numel = (1 << 28) if device.startswith("cuda") else (1 << 22)
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        if device.startswith("cuda"):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[5:])


def _drive(engine: LLMEngine, on_step=None) -> list:
    """Step until nothing is left; returns every output. `on_step(seconds, outputs)` after each step."""
    outputs = []
    while engine.has_unfinished():
        steps = engine.num_steps
        start = time.perf_counter()
        out = engine.step()
        seconds = time.perf_counter() - start
        outputs += out
        if on_step is not None:
            on_step(seconds, out)
        if engine.num_steps == steps and not out:
            time.sleep(0.001)  # nothing could run: an adapter is still loading
    return outputs


def run_requests(engine: LLMEngine, requests, digests: dict | None, tag: str) -> dict:
    """All requests submitted at once, run to the end: tokens per second, steps, TTFTs."""
    sampling = {
        r.index: SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    }
    start = time.perf_counter()
    for r in requests:
        adapter = digests[r.adapter] if digests is not None else None
        engine.add_request(f"{tag}-{r.index}", r.prompt, sampling[r.index], adapter=adapter, tenant=TENANT)
    steps0 = engine.num_steps
    finals = [o for o in _drive(engine) if o.finished]
    seconds = time.perf_counter() - start
    short = [
        o.request_id
        for o in finals
        if len(o.token_ids) != sampling[int(o.request_id.rsplit("-", 1)[1])].max_tokens
    ]
    ttfts = sorted(o.usage.ttft_ms for o in finals if o.usage.ttft_ms is not None)
    return {
        "requests": len(requests), "distinct_adapters": len({r.adapter for r in requests}) if digests else 0,
        "prompt_tokens": sum(len(r.prompt) for r in requests), "output_tokens": sum(r.max_tokens for r in requests),
        "seconds": seconds, "steps": engine.num_steps - steps0,
        "output_tokens_per_s": sum(r.max_tokens for r in requests) / seconds,
        "ttft_ms_p50": _quantile(ttfts, 0.5), "ttft_ms_p90": _quantile(ttfts, 0.9),
        "errors": sorted({o.error for o in finals if o.error})[:5], "wrong_length": short[:5],
    }  # fmt: skip


def score_reference(engine: LLMEngine, references: list[dict], digests: dict) -> dict:
    """The engine's log-probability of every token PEFT chose, teacher-forced, against PEFT's own."""
    diffs, decisive, flips, flips_decisive = [], 0, 0, 0
    for i, ref in enumerate(references):
        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
        adapter = digests[ref["adapter"]] if ref["adapter"] is not None else None
        engine.add_request(
            f"ref-{i}", ref["prompt"] + ref["tokens"], sampling, adapter=adapter, tenant=TENANT
        )
        (final,) = [o for o in _drive(engine) if o.finished]
        if final.error:
            raise RuntimeError(f"reference request {i} failed: {final.error}")
        start = len(ref["prompt"])
        for j, (token, logprob, gap) in enumerate(
            zip(ref["tokens"], ref["logprobs"], ref["gaps"], strict=True)
        ):
            entry = final.prompt_logprobs[start + j]
            assert entry.token_id == token, (entry.token_id, token)
            diffs.append(abs(entry.logprob - logprob))
            top = max(entry.top, key=entry.top.get)
            flips += top != token
            if gap > 0.1:
                decisive += 1
                flips_decisive += top != token
    return {
        "sequences": len(references), "positions": len(diffs), "max_abs_logprob_diff": max(diffs),
        "mean_abs_logprob_diff": statistics.mean(diffs), "decisive_positions": decisive,
        "top1_differs_decisive": flips_decisive, "top1_differs": flips,
    }  # fmt: skip


def decode_batch(
    engine: LLMEngine, batch, digests: dict | None, wanted: int, max_tokens: int, tag: str, profiler=None
) -> list[dict]:
    """Pure decode steps of `batch` requests: [{seconds, contexts, adapters}] for `wanted` steps after the
    step in which the last request got its first token (and one more, dropped: it may compile kernels for
    the new batch shape); then every request is aborted. A torch profiler, if given, runs over those steps."""
    wanted += 1
    ids = {}
    for r in batch:
        rid = f"{tag}-{r.index}"
        ids[rid] = r
        adapter = digests[r.adapter] if digests is not None else None
        engine.add_request(rid, r.prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           adapter=adapter, tenant=TENANT)  # fmt: skip
    generated = dict.fromkeys(ids, 0)
    records: list[dict] = []
    state = {"before": None, "profiling": False}

    def on_step(seconds: float, outputs) -> None:
        before = state["before"]
        emitted = {o.request_id for o in outputs if o.new_token_ids}
        if before is not None and len(emitted) == len(batch) and len(records) < wanted:
            records.append({"seconds": seconds, "contexts": before,
                            "adapters": len({r.adapter for r in batch}) if digests else 0})  # fmt: skip
        for o in outputs:
            generated[o.request_id] += len(o.new_token_ids)
        if all(generated.values()):
            state["before"] = [
                len(ids[rid].prompt) + generated[rid] for rid in ids
            ]  # context of the next step
        if profiler is not None and len(records) == 1 and not state["profiling"]:
            profiler.start()
            state["profiling"] = True
        if len(records) >= wanted:
            if state["profiling"]:
                profiler.stop()
                state["profiling"] = False
            for rid in ids:
                engine.abort(rid)

    _drive(engine, on_step)
    if state["profiling"]:
        profiler.stop()
    return records[1:]


def profile_decode(engine: LLMEngine, batch, digests: dict, steps: int, max_tokens: int, device: str) -> dict:
    """Where the time of a decode step with adapters goes: torch.profiler over `steps` pure decode steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    profiler = profile(activities=activities)
    records = decode_batch(engine, batch, digests, steps, max_tokens, "profile", profiler=profiler)
    averages = profiler.key_averages()
    sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    device_us = sum(e.self_device_time_total for e in averages)
    # exactly the profiled steps, the profiler's own overhead included
    wall_us = sum(r["seconds"] for r in records) * 1e6
    table = averages.table(sort_by=sort, row_limit=25)
    print(table, flush=True)
    return {"steps": len(records), "wall_us": wall_us, "device_kernel_us": device_us,
            "device_busy_fraction": device_us / wall_us if wall_us and device.startswith("cuda") else None,
            "table": table}  # fmt: skip


def summarize_decode(
    records: list[dict], shape, itemsize: int, rank: int, bandwidth: float, *, lora: bool
) -> dict:
    if not records:
        return {"steps": 0}
    batch = len(records[0]["contexts"])
    ratios, roofline = [], []
    for rec in records:
        moved = llama_shape.weight_bytes_per_decode_step(shape, batch, itemsize)
        moved += llama_shape.kv_bytes_per_decode_step(shape, rec["contexts"], itemsize)
        moved += rec["adapters"] * llama_shape.adapter_bytes(shape, rank, itemsize) if lora else 0
        roofline.append(moved / bandwidth)
        ratios.append(moved / bandwidth / rec["seconds"])
    step_s = statistics.median(r["seconds"] for r in records)
    kv = [llama_shape.kv_bytes_per_decode_step(shape, r["contexts"], itemsize) for r in records]
    return {
        "batch": batch, "steps": len(records), "adapters": records[0]["adapters"], "step_ms_p50": step_s * 1e3,
        "step_ms_min": min(r["seconds"] for r in records) * 1e3, "step_ms_max": max(r["seconds"] for r in records) * 1e3,
        "tokens_per_s": batch / step_s, "roofline_ms_p50": statistics.median(roofline) * 1e3,
        "roofline_ratio_p50": statistics.median(ratios),
        "bytes": {"weights": llama_shape.weight_bytes_per_decode_step(shape, batch, itemsize),
                  "kv_p50": statistics.median(kv),
                  "adapters": records[0]["adapters"] * llama_shape.adapter_bytes(shape, rank, itemsize) if lora else 0},
        "mean_context": statistics.mean(c for r in records for c in r["contexts"]),
    }  # fmt: skip


def ttft(engine: LLMEngine, prompt: list[int], digest: str, rid: str) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), adapter=digest,
                       tenant=TENANT)  # fmt: skip
    finals = [o for o in _drive(engine) if o.finished]
    wall_ms = (time.perf_counter() - start) * 1e3
    if not finals or finals[0].error:
        raise RuntimeError(f"request {rid} failed: {finals[0].error if finals else 'no output'}")
    return finals[0].usage.ttft_ms if finals[0].usage.ttft_ms is not None else wall_ms


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else float("inf"))
