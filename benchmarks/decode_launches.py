"""Kernel launches and host time of one decode step on the Llama-3-8B shape, with and without LoRA, this tree
against a baseline commit, measured on CPU: no GPU needed.

    .venv/bin/python benchmarks/decode_launches.py --baseline d2b9e20 --rounds 3

The step: batch 64, one new token per sequence at 512 cached tokens; hidden 4096, 32 layers, 32 heads, 8 KV heads,
head_dim 128, intermediate 14336, vocab 128256, bf16; "with LoRA": 64 distinct rank-16 adapters, one per sequence,
on all seven projections. Every op runs on its Triton launcher (kernels.route_cpu_to_triton).

What is timed (host milliseconds per step: this thread's CPU time, so that other processes on a shared machine
weigh less; the fastest of --steps steps after a warm-up step, as timeit does): the step's LoRA metadata
(this tree: LoRABatch.fill, the same 64 adapters as the step before; the baseline: nothing, its model runner
reuses the previous step's LoRABatch and the tables it cut), Context.build, and the model's forward with
compute_logits of the 64 sampled rows. The launchers tune as on an H100 (132 SMs: split-K where the baseline
chose it). Weights, activations, KV pages and page tables live on torch's "meta"
device, so a torch op costs its dispatch and shape inference but computes nothing. Every Triton launch
`kernel[grid](...)` is replaced by a counting no-op: the launchers' own Python (checks, tuning, allocations,
casts, metadata) is timed, Triton's launch (argument binding, the driver call) and every kernel body are not.
Sampling, scheduling and the adapter pool are not part of the step timed here.

What is counted: launches = Triton launches + torch ops on the device (meta) tensors that would launch a
kernel on a GPU (views, empty allocations and other metadata-only ops are not counted), per decoder layer
(inside the layers' forward) and outside them (embedding, final norm, lm_head, the LoRA metadata).

Baseline and this tree run in alternating subprocesses (each its own Python, same machine), --rounds times; the
spread is over the rounds. The baseline tree is `git archive <commit>` unpacked in a temporary folder.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK_SIZE = 16
H100_SMS = 132


class Counter:
    """Counts Triton launches (every JITFunction's `kernel[grid](...)` made a no-op) and, while `ops` is on, the
    torch ops on meta tensors that launch a kernel; `layer` says whether a decoder layer's forward is running."""

    def __init__(self) -> None:
        self.inside = {"triton": 0, "torch": 0}
        self.outside = {"triton": 0, "torch": 0}
        self.layer = False
        self.syncs = 0  # .item() and the like (a host sync on a GPU)

    def add(self, kind: str) -> None:
        (self.inside if self.layer else self.outside)[kind] += 1

    def reset(self) -> None:
        self.inside = {"triton": 0, "torch": 0}
        self.outside = {"triton": 0, "torch": 0}


@contextlib.contextmanager
def no_op_launches(counter: Counter):
    """While inside: every Triton launch `kernel[grid](...)` (compiled or interpreted) is a counting no-op, every
    op goes to its Triton launcher, and the launchers tune as on an H100; all restored on exit."""
    from triton.runtime.jit import KernelInterface

    import kernels

    def launch(*args, **kwargs):
        counter.add("triton")

    patched = [(module, module.multiprocessor_count) for name, module in list(sys.modules.items())
               if name.split(".")[0] == "kernels" and hasattr(module, "multiprocessor_count")]
    getitem, routed = KernelInterface.__getitem__, kernels._CPU_TO_TRITON
    KernelInterface.__getitem__ = lambda self, grid: launch
    kernels.route_cpu_to_triton(True)
    for module, _ in patched:
        module.multiprocessor_count = lambda device: H100_SMS
    try:
        yield
    finally:
        KernelInterface.__getitem__ = getitem
        kernels.route_cpu_to_triton(routed)
        for module, original in patched:
            module.multiprocessor_count = original


def mark_layers(counter: Counter, model) -> None:
    """counter.layer is True while a decoder layer's forward runs."""
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: setattr(counter, "layer", True))
        layer.register_forward_hook(lambda *_: setattr(counter, "layer", False))


def leaves(values) -> list:
    """An op's arguments with its lists and tuples (aten.cat's tensors) opened."""
    return [leaf for value in values for leaf in (leaves(value) if isinstance(value, list | tuple) else [value])]


def op_counting_mode(counter: Counter):
    """A TorchDispatchMode counting the ops on meta tensors that would launch a GPU kernel."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    no_kernel = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
                 aten.lift_fresh.default, aten.promote_types.default}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            flat = [a for a in leaves((*args, *kwargs.values())) if isinstance(a, torch.Tensor)]
            if func == aten._local_scalar_dense.default:
                counter.syncs += 1
            elif any(t.device.type == "meta" for t in flat) and func not in no_kernel:
                # an op that may return a view (reshape, to) launches a copy when it does not
                copied = not (isinstance(out, torch.Tensor)
                              and out.untyped_storage()._cdata == flat[0].untyped_storage()._cdata)
                if not func.is_view or copied:
                    counter.add("torch")
            return out

    return Mode()


def build(num_layers: int, hidden: int, batch: int, adapters: int, rank: int, context: int):
    """(model, memory, step()) of the tree on sys.path: step() builds the step's metadata and runs the forward."""
    import torch

    from engine.context import Context
    from engine.lora_batch import LoRABatch
    from engine.lora_modules import MODULE_INDEX, MODULES
    from engine.models.registry import model_class
    from engine.parallel.communicator import Communicator
    from engine.rank_model import attach_pages

    meta = torch.device("meta")
    config = dict(HF_CONFIG, num_hidden_layers=num_layers)
    if hidden != HF_CONFIG["hidden_size"]:  # a small shape (tests)
        config.update(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, vocab_size=512)
    cls = model_class(config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with meta:
            model = cls(cls.read_spec(config), Communicator())
            model.build_rope_cache()
    finally:
        torch.set_default_dtype(default)
    blocks_per_seq = context // BLOCK_SIZE + 1
    memory = attach_pages(model, num_pages=batch * blocks_per_seq + 64, block_size=BLOCK_SIZE,
                          kv_cache_dtype="auto", device=meta)
    model.eval()
    num_modules = len(MODULES)
    ranks = torch.zeros(num_layers, num_modules, dtype=torch.int32)  # [L, M] host
    for name in PROJECTIONS:
        ranks[:, MODULE_INDEX[name]] = rank
    token_adapters = [i % adapters for i in range(batch)] if adapters else []
    block_tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(batch)]
    positions = [context] * batch
    slot_mapping = [t[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for t in block_tables]
    input_ids = torch.zeros(batch, dtype=torch.int64, device=meta)
    lora = None
    if adapters:
        first_expert = MODULE_INDEX[MODULES[-2]]  # the page tables cover the modules before the experts'
        offsets = torch.zeros(num_layers, first_expert, 2, rank, dtype=torch.int64, device=meta)
        experts = torch.zeros(num_layers, 2, 2, 0, dtype=torch.int64, device=meta)
        a_source = torch.arange(num_modules).repeat(num_layers, 1)
        if hasattr(LoRABatch, "fill"):  # static buffers refilled in place (this tree)
            from engine.lora_batch import AdapterTables

            tables = [AdapterTables(key=u, offsets=offsets, expert_offsets=experts, ranks=ranks.to(meta),
                                    scaling=torch.ones(num_layers, num_modules, device=meta), host_ranks=ranks,
                                    a_source=a_source) for u in range(adapters)]
            batch_lora = LoRABatch(num_layers=num_layers, device=meta, zero_row=memory.zero_row)

            def lora_step():
                return batch_lora.fill(token_adapters, tables)
        else:  # the baseline: LoRABatch.build once, reused while the adapters and tokens stay the same
            stacked = (offsets.expand(adapters, *offsets.shape).contiguous(), ranks.expand(adapters, -1, -1),
                       torch.ones(adapters, num_layers, num_modules, device=meta),
                       a_source.expand(adapters, -1, -1), experts.expand(adapters, *experts.shape).contiguous())
            built = LoRABatch.build(torch.tensor(token_adapters, dtype=torch.int32, device=meta), stacked)

            def lora_step():
                return built
        lora = lora_step

    graph_step = None
    try:
        from engine.cuda_graph import DecodeGraphs
        from engine.step_inputs import StepInputs
    except ImportError:  # the baseline has no graph path
        DecodeGraphs = None
    if DecodeGraphs is not None:
        graphs = DecodeGraphs(model=model, max_batch=batch, max_blocks=blocks_per_seq, capture=False, device=meta)
        inputs = StepInputs(input_ids=[0] * batch, positions=positions, slot_mapping=slot_mapping,
                            block_tables=block_tables, context_lens=[context + 1] * batch,
                            cu_seqlens_q=list(range(batch + 1)), prompt_lens=[context] * batch,
                            token_slots=list(range(batch)) if adapters else [-1] * batch, adapters=[])
        hidden_states = torch.zeros(batch, config["hidden_size"], dtype=torch.bfloat16, device=meta)

        def graph_step():
            """What the host does per decode step on CUDA with the graph captured: the adapters' metadata
            (LoRABatch.fill), the static buffers' refill and copy (DecodeGraphs.fill), then graph.replay() (one
            cudaGraphLaunch: not run here, counted as one launch), and the logits of the sampled rows."""
            if lora:
                lora()
            graphs.fill(inputs, graphs.bucket(batch))
            return model.compute_logits(hidden_states)

    def step():
        ctx = Context.build(positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
                            context_lens=[context + 1] * batch, cu_seqlens_q=list(range(batch + 1)),
                            prompt_lens=[context] * batch, lora=lora() if lora else None, device=meta)
        hidden_states = model(input_ids, ctx)
        return model.compute_logits(hidden_states)

    return model, step, graph_step


def measure(*, num_layers: int, hidden: int, batch: int, adapters: int, rank: int, context: int, steps: int) -> dict:
    """Launch counts and host ms of one step in the tree on sys.path."""
    import torch

    counter = Counter()
    with no_op_launches(counter), torch.inference_mode():
        model, step, graph_step = build(num_layers, hidden, batch, adapters, rank, context)
        mark_layers(counter, model)
        step()  # warm up: the baseline cuts and keeps its tables, lru caches fill
        counter.reset()
        with op_counting_mode(counter):
            step()
        counts = {"inside": dict(counter.inside), "outside": dict(counter.outside), "syncs": counter.syncs}
        times = []
        for _ in range(steps):
            start = time.thread_time()
            step()
            times.append(time.thread_time() - start)
        host_ms = min(times) * 1e3  # the least disturbed step: the others only add other processes' noise
        graph_ms = None
        if graph_step is not None:
            graph_step()
            times = []
            for _ in range(steps):
                start = time.thread_time()
                graph_step()
                times.append(time.thread_time() - start)
            graph_ms = min(times) * 1e3
    per_layer = sum(counts["inside"].values()) / num_layers
    return {"per_layer": per_layer, "counts": counts, "host_ms": host_ms, "graph_ms": graph_ms,
            "total": sum(counts["inside"].values()) + sum(counts["outside"].values())}


def _child(args) -> None:
    result = {}
    for adapters in (0, args.adapters):
        result[str(adapters)] = measure(num_layers=args.layers, hidden=args.hidden, batch=args.batch,
                                        adapters=adapters, rank=args.rank, context=args.context, steps=args.steps)
    print(json.dumps(result))


def _run(tree: Path, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--layers", str(args.layers),
               "--batch", str(args.batch), "--adapters", str(args.adapters), "--rank", str(args.rank),
               "--context", str(args.context), "--steps", str(args.steps), "--hidden", str(args.hidden)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ms ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="d2b9e20", help="commit to compare against ('' for none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path[0] = os.getcwd()  # the tree measured, not benchmarks/ (whose kernels.py would shadow the package)
        _child(args)
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"after": here}
    with tempfile.TemporaryDirectory(prefix="quilt-baseline-") as folder:
        if args.baseline:
            archive = subprocess.run(["git", "-C", str(here), "archive", args.baseline], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
            trees = {"before": Path(folder), "after": here}
        runs = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():  # alternating
                runs[name].append(_run(tree, args))
    print(f"one decode step, batch {args.batch}, {args.layers} layers, hidden {args.hidden}, "
          f"{args.adapters} distinct rank-{args.rank} adapters on all 7 projections; {args.rounds} rounds "
          "(median, min-max)")
    print(f"{'':10} {'launches/layer':>15} {'+LoRA':>7} {'LoRA adds':>10} {'step total':>11} "
          f"{'host ms, no LoRA':>28} {'host ms, LoRA':>28}")
    host = {}
    for name, results in runs.items():
        base, lora = results[0]["0"], results[0][str(args.adapters)]
        host[name] = ([r[str(args.adapters)]["host_ms"] for r in results], [r["0"]["host_ms"] for r in results])
        print(f"{name:10} {base['per_layer']:15.2f} {lora['per_layer']:7.2f} {lora['per_layer'] - base['per_layer']:10.2f}"
              f" {lora['total']:11d} {_spread(host[name][1]):>28} {_spread(host[name][0]):>28}")
    share = {name: [lora - base for lora, base in zip(*host[name], strict=True)] for name in host}  # same process
    for name, values in share.items():
        print(f"{name:10} LoRA's own host time (with minus without, per round): {_spread(values)}")
    graph = [r[str(args.adapters)]["graph_ms"] for r in runs["after"]]
    graph_base = [r["0"]["graph_ms"] for r in runs["after"]]
    if graph[0] is not None:
        print(f"{'after, CUDA graph':18} host ms per step with the decode graph replayed (metadata + buffer refill + "
              f"logits; the replay itself, one launch, not timed): no LoRA {_spread(graph_base)}, "
              f"LoRA {_spread(graph)}")
    if "before" in host and graph[0] is not None:
        pairs = [b / a for b, a in zip(host["before"][0], graph, strict=True)]
        print(f"host time with LoRA, eager before / CUDA graph after: "
              f"{statistics.median(host['before'][0]) / statistics.median(graph):.1f}x "
              f"(per round {min(pairs):.1f}-{max(pairs):.1f}x)")
    if "before" in host:
        ratio = statistics.median(host["before"][0]) / statistics.median(host["after"][0])
        ratio_base = statistics.median(host["before"][1]) / statistics.median(host["after"][1])
        pairs = [b / a for b, a in zip(host["before"][0], host["after"][0], strict=True)]
        print(f"host time with LoRA falls {ratio:.1f}x (per round {min(pairs):.1f}-{max(pairs):.1f}x); "
              f"without LoRA {ratio_base:.1f}x; LoRA's own "
              f"{statistics.median(share['before']) / max(statistics.median(share['after']), 1e-9):.1f}x")


if __name__ == "__main__":
    main()
