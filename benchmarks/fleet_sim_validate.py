"""The fleet simulator's engine model, fitted and checked on this machine (`python -m benchmarks.fleet_sim
--calibrate | --validate`).

calibrate: runs the real engine in process on the demo model and fits, by least squares over every step,
    step_ms = base + per_token × tokens in the step + per_seq × sequences in the step;
    the adapter load is a cold request's time to first token minus a warm one's (an adapter read from disk).
validate: starts 2 real engine servers, sends them Poisson traffic over the demo adapters, routed by the gateway's
    real `choose` on their /v1/state (re-read once a second, as heartbeats), and measures TTFT at the client; then
    simulates the same workload on 2 engines with the model calibrated just before, plus the per-request overhead
    an idle engine shows (HTTP, tokenizing, the event loop), and compares TTFT p50 (goal: within 25%).
"""

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.fleet_simulation import REPO, Simulation, percentile
from benchmarks.fleet_workload import EngineModel, Workload

DEMO = REPO / "var" / "demo-model"
TOKEN = "fleet-sim-validation-token"


def demo_model() -> Path:
    if not (DEMO / "config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.demo", "--out", str(DEMO)], check=True, cwd=REPO)
    return DEMO


def calibrate(max_num_seqs: int = 32, *, clock: str = "wall") -> EngineModel:
    """clock "wall": times as this machine gives them now (shared cores: what real engines here see); "cpu": the
    process's CPU time, what the same code costs on cores of its own (the fleet runs' model)."""
    import numpy
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)  # one core per engine: the validation's engines run with OMP_NUM_THREADS=1
    model = demo_model()
    engine = LLMEngine(EngineConfig(model=str(model), max_num_seqs=max_num_seqs))
    steps: list[tuple[int, int, float]] = []
    run = engine.runner.run
    now = time.perf_counter if clock == "wall" else time.process_time

    def timed(out, *rest):
        started = now()
        result = run(out, *rest)
        steps.append((out.total_tokens, len(out.seqs), (now() - started) * 1000))
        return result

    engine.runner.run = timed
    rng = random.Random(0)
    rid = 0
    for batch in (1, 2, 4, 8, 16, 32, 1, 8, 32, 4, 16):  # prefills of mixed sizes, then decodes at each batch size
        for _ in range(batch):
            prompt = [rng.randrange(3, 700) for _ in range(rng.randint(8, 120))]
            engine.add_request(f"c{rid}", prompt, SamplingParams(max_tokens=rng.randint(8, 24), ignore_eos=True))
            rid += 1
        while engine.has_unfinished():
            engine.step()
    steps = steps[5:]  # the first steps warm up
    x = numpy.array([[1.0, tokens, seqs] for tokens, seqs, _ in steps])
    y = numpy.array([ms for _, _, ms in steps])
    (base, per_token, per_seq), *_ = numpy.linalg.lstsq(x, y, rcond=None)

    load_ms = []
    for path in sorted((model / "adapters").iterdir()):
        digest = engine.add_adapter(path)
        for _ in range(3):
            engine.evict_adapter(digest)
            engine.register_adapter(digest, path)
            cold = _first_token_ms(engine, digest, f"cold{rid}", now)
            warm = _first_token_ms(engine, digest, f"warm{rid}", now)
            rid += 1
            load_ms.append(cold - warm)
    engine.shutdown()
    base, per_token, per_seq = float(base), float(per_token), float(per_seq)
    return EngineModel(step_base_ms=round(max(0.0, base), 3), per_token_ms=round(max(0.0, per_token), 5),
                       per_seq_ms=round(max(0.0, per_seq), 4), adapter_load_ms=round(statistics.median(load_ms), 2),
                       max_num_seqs=max_num_seqs)  # fmt: skip


def _first_token_ms(engine, digest: str, request_id: str, now) -> float:
    from engine.sampling_params import SamplingParams

    started = now()
    engine.add_request(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=1), adapter=digest)
    while engine.has_unfinished():
        engine.step()
    return (now() - started) * 1000


# validation against real engines
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(model: Path, port: int, max_num_seqs: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "QUILT_ENGINE_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "engine", "--model", str(model), "--port", str(port), "--log-level", "warning",
               "--max-num-seqs", str(max_num_seqs), "--usage-spool", str(log.with_suffix(".spool"))]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def _drive(urls: list[str], workload: Workload, adapters: list[tuple[str, str]]) -> tuple[list[float], float]:
    """Poisson traffic routed by the gateway's `choose`; returns each request's TTFT (s) and the idle overhead."""
    import httpx

    from engine.contract import state_read
    from gateway.route_score import Fleet, Loads, candidate_from_state, choose

    headers = {"Authorization": f"Bearer {TOKEN}"}
    rng = random.Random(workload.seed)
    ttft: list[float] = []
    names = [f"engine-{i}" for i in range(len(urls))]
    in_flight = [0] * len(urls)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:

        async def snapshot():
            states = [state_read((await client.get(f"{url}/v1/state", headers=headers)).json()) for url in urls]
            return Fleet([candidate_from_state(n, s) for n, s in zip(names, states, strict=True)]), Loads(
                [s.load for s in states], in_flight)

        async def one(index: int, adapter: tuple[str, str], prompt: list[int], max_tokens: int, record: bool):
            nonlocal loads
            body = {"adapter": {"digest": adapter[0], "path": adapter[1]}, "prompt_token_ids": prompt,
                    "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}
            in_flight[index] += 1
            started = time.perf_counter()
            first = None
            async with client.stream("POST", f"{urls[index]}/v1/generate", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if first is None and line.strip():
                        first = time.perf_counter() - started
            in_flight[index] -= 1
            if loads.in_flight[index] > 0:
                loads.ended(index)
            if record:
                ttft.append(first)
            return first

        fleet, loads = await snapshot()
        idle = []  # one request at a time on idle engines: what a request costs beyond the model's steps
        for k in range(12):
            idle.append(await one(k % len(urls), adapters[k % len(adapters)], [rng.randrange(3, 700) for _ in range(16)],
                                  1, record=False))  # fmt: skip
        fleet, loads = await snapshot()
        tasks, started, last_snapshot = [], time.perf_counter(), 0.0
        t = 0.0
        while True:
            t += rng.expovariate(workload.rate)
            if t >= workload.duration_s:
                break
            await asyncio.sleep(max(0.0, started + t - time.perf_counter()))
            if time.perf_counter() - started - last_snapshot >= 1.0:
                fleet, loads = await snapshot()
                last_snapshot = time.perf_counter() - started
            adapter = adapters[rng.randrange(len(adapters))]
            prompt = [rng.randrange(3, 700) for _ in range(rng.randint(*workload.user_tokens))]
            index = choose(fleet, adapter=adapter[0], fingerprints=[], loads=loads.values)
            loads.started(index)
            tasks.append(asyncio.create_task(one(index, adapter, prompt, rng.randint(*workload.output_tokens), True)))
        await asyncio.gather(*tasks)
    return ttft, statistics.median(idle)


def validate(args) -> int:
    model = demo_model()
    max_num_seqs = 32
    print("calibrating the engine model on this machine ...", flush=True)
    fitted = calibrate(max_num_seqs=max_num_seqs)
    print(f"fitted: {fitted}", flush=True)
    adapters = []
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    probe = LLMEngine(EngineConfig(model=str(model), max_num_seqs=4))
    for path in sorted((model / "adapters").iterdir()):
        adapters.append((probe.add_adapter(path), str(path)))
    probe.shutdown()
    workload = Workload(rate=args.rate if args.rate != 10_000.0 else 12.0, duration_s=min(args.duration * 5, 40.0),
                        adapters=len(adapters), tenants=1, shared_prompt_share=0.0, user_tokens=(16, 96),
                        output_tokens=(8, 32), seed=args.seed)  # fmt: skip
    logs = REPO / "var" / "fleet-sim"
    logs.mkdir(parents=True, exist_ok=True)
    ports = [_free_port(), _free_port()]
    processes = [_launch(model, port, max_num_seqs, logs / f"engine-{i}.log") for i, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        import httpx

        deadline = time.monotonic() + 180
        for url in urls:
            while True:
                try:
                    if httpx.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {url} did not start (logs in {logs})")
                time.sleep(0.2)
        print(f"driving 2 engines at {workload.rate} req/s for {workload.duration_s:.0f} s ...", flush=True)
        measured, idle_s = asyncio.run(_drive(urls, workload, adapters))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
    # What an idle engine adds beyond one prefill step of a 16-token prompt: HTTP, tokenizing, queue hand-offs.
    overhead_ms = max(0.0, idle_s * 1000 - fitted.step_ms(16, 1))
    simulated = []
    for seed in range(5):  # the simulator's own spread: five draws of the same workload
        result = Simulation(policy="full", workload=Workload(**{**workload.__dict__, "seed": seed}), engines=2,
                            model=fitted, gateways=1).run()  # fmt: skip
        simulated.append(result["ttft_p50_ms"] + overhead_ms)
    measured.sort()
    measured_p50 = percentile(measured, 50) * 1000
    simulated_p50 = statistics.median(simulated)
    error = (simulated_p50 - measured_p50) / measured_p50
    print(json.dumps({"requests": len(measured), "rate": workload.rate, "fitted": fitted.__dict__,
                      "idle_overhead_ms": round(overhead_ms, 2), "measured_ttft_p50_ms": round(measured_p50, 2),
                      "measured_ttft_p99_ms": round(percentile(measured, 99) * 1000, 2),
                      "simulated_ttft_p50_ms": round(simulated_p50, 2), "error": round(error, 3)}, indent=2))  # fmt: skip
    print(f"simulated vs measured TTFT p50: {simulated_p50:.1f} ms vs {measured_p50:.1f} ms ({error:+.0%}); "
          f"goal within 25%: {'met' if abs(error) <= 0.25 else 'NOT met'}")
    return 0
