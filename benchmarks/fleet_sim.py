"""Routing policies compared on a simulated fleet (benchmarks/fleet_simulation.py: the gateway's real routing
function against simulated engines), at a scale one machine cannot run.

    .venv/bin/python -m benchmarks.fleet_sim                      # the policy table: 100 engines, 10K req/s
    .venv/bin/python -m benchmarks.fleet_sim --policies fixed full --scenarios zipf --runs 3
                                                                  # the score on load times against fixed weights
    .venv/bin/python -m benchmarks.fleet_sim --policies fixed full --scenarios zipf --runs 3 --rate 1000 \
        --adapter-load-ms 100 --host-load-ms 4                    # the same with an 84 MB adapter's slower loads
    .venv/bin/python -m benchmarks.fleet_sim --calibrate          # fit the engine model on this machine's CPU
    .venv/bin/python -m benchmarks.fleet_sim --validate           # 2 real engines vs the simulator, TTFT p50

The engine model's step and adapter-load times are fitted by `--calibrate` to the real engine on the demo model
(CPU), and divided by `--speedup` to stand for a faster device.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import fleet_sim_validate
from benchmarks.fleet_simulation import Simulation
from benchmarks.fleet_workload import CPU_MODEL, EngineModel, Workload
from gateway.route_score import COST  # platform/ is on the path: benchmarks.fleet_simulation puts it there

POLICIES = ("round-robin", "least-load", "affinity-only", "fixed", "full")  # fixed: route_score.FIXED


def table(rows: list[dict]) -> str:
    lines = ["| scenario | policy | requests | TTFT p50 / p99 (ms) | adapter loads/s | prefix hit rate | busiest/mean "
             "load | decision p50 / p99 (µs) | decision CPU p50 / p99 (µs) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        decision = (f"{r['decision_p50_us']:.1f} / {r['decision_p99_us']:.1f} | {r['decision_cpu_p50_us']:.1f} / "
                    f"{r['decision_cpu_p99_us']:.1f}" if r["decision_p99_us"] else "— | —")
        lines.append(f"| {r['scenario']} | {r['policy']} | {r['requests']} | {r['ttft_p50_ms']:.1f} / "
                     f"{r['ttft_p99_ms']:.1f} | {r['adapter_loads_per_s']:.0f} | {r['prefix_hit_rate']:.2f} | "
                     f"{r['busiest_over_mean']:.2f} | {decision} |")
    return "\n".join(lines)


def spread_table(rows: list[dict]) -> str:
    """TTFT per (scenario, policy) over the runs: the median, and the lowest to the highest run."""
    lines = ["| scenario | policy | runs | TTFT p50 (ms) | TTFT p99 (ms) | adapter loads/s | busiest/mean load |",
             "|---|---|---:|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["policy"]), []).append(r)

    def spread(runs: list[dict], key: str, digits: int = 1) -> str:
        values = sorted(r[key] for r in runs)
        return f"{statistics.median(values):.{digits}f} ({values[0]:.{digits}f}–{values[-1]:.{digits}f})"

    for (scenario, policy), runs in groups.items():
        lines.append(f"| {scenario} | {policy} | {len(runs)} | {spread(runs, 'ttft_p50_ms')} | "
                     f"{spread(runs, 'ttft_p99_ms')} | {spread(runs, 'adapter_loads_per_s', 0)} | "
                     f"{spread(runs, 'busiest_over_mean', 2)} |")
    return "\n".join(lines)


def with_load_times(model: EngineModel, args) -> EngineModel:
    """The model with the adapter load times given on the command line, if any (milliseconds from disk, from host)."""
    changes = {name: value for name, value in (("adapter_load_ms", args.adapter_load_ms),
                                               ("host_load_ms", args.host_load_ms)) if value is not None}
    return dataclasses.replace(model, **changes)


def load_model(path: Path | None) -> EngineModel:
    if path is None:
        return CPU_MODEL
    return EngineModel(**json.loads(path.read_text()))


def compare(args) -> list[dict]:
    model = with_load_times(load_model(args.model).faster(args.speedup), args)
    rows = []
    scenarios = {"zipf": 0.0, "hot spot 30%": args.hot_share}
    weights = dataclasses.replace(COST, spill_ratio=args.spill_ratio, spill_gap=args.spill_gap,
                                  spill_step=args.spill_step)
    for run in range(args.runs):  # run r: the same traffic (seed + r) for every policy
        for scenario in args.scenarios:
            workload = Workload(rate=args.rate, duration_s=args.duration, adapters=args.adapters,
                                hot_share=scenarios[scenario], seed=args.seed + run)
            for policy in args.policies:
                started = time.perf_counter()
                result = Simulation(policy=policy, workload=workload, engines=args.engines, model=model,
                                    gateways=args.gateways, weights=weights).run()
                result["scenario"], result["run"] = scenario, run
                rows.append(result)
                print(f"  run {run} {scenario:13} {policy:13} {time.perf_counter() - started:6.1f} s wall  "
                      f"ttft p50 {result['ttft_p50_ms']:.1f} p99 {result['ttft_p99_ms']:.1f} ms", file=sys.stderr,
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim", description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=100)
    parser.add_argument("--rate", type=float, default=10_000.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=6.0, help="simulated seconds of traffic")
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--hot-share", type=float, default=0.3)
    parser.add_argument("--gateways", type=int, default=4, help="gateway processes, each with its own view")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="divide the fitted CPU step and load times by this (a GPU's ratio to this CPU)")
    parser.add_argument("--model", type=Path, help="an engine model JSON (from --calibrate) instead of CPU_MODEL")
    parser.add_argument("--adapter-load-ms", type=float, help="an adapter's load from disk, in place of the model's")
    parser.add_argument("--host-load-ms", type=float, help="an adapter's load from host memory, in place of the model's")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1, help="each with its own traffic (seeds seed, seed + 1, ...)")
    parser.add_argument("--scenarios", nargs="+", default=["zipf", "hot spot 30%"], choices=["zipf", "hot spot 30%"])
    parser.add_argument("--spill-ratio", type=float, default=COST.spill_ratio)
    parser.add_argument("--spill-gap", type=float, default=COST.spill_gap)
    parser.add_argument("--spill-step", type=float, default=COST.spill_step)
    parser.add_argument("--calibrate", action="store_true", help="fit the engine model on this machine and print it")
    parser.add_argument("--validate", action="store_true", help="2 real engines against the simulator")
    args = parser.parse_args(argv)
    if args.calibrate:
        for clock in ("cpu", "wall"):
            print(clock, json.dumps(dataclasses.asdict(fleet_sim_validate.calibrate(clock=clock))))
        return 0
    if args.validate:
        return fleet_sim_validate.validate(args)
    model = with_load_times(load_model(args.model).faster(args.speedup), args)
    print(f"{args.engines} engines, {args.rate:.0f} req/s for {args.duration:.0f} s, {args.adapters} adapters "
          f"(Zipf 1.0), {args.gateways} gateway processes; engine model {model}", flush=True)
    rows = compare(args)
    print(table(rows))
    if args.runs > 1:
        print()
        print(spread_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
