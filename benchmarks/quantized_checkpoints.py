"""Pre-quantized checkpoints against their bf16 original, side by side in one process: decode tokens/s with 16
distinct adapters, and the weight bytes each engine holds. One suite per format (the GPU suite's steps):

    python benchmarks/quantized_checkpoints.py --suite w4a16 --device cuda --shape llama3-8b   # step `w4a16`
    python benchmarks/quantized_checkpoints.py --suite fp8ckpt --device cuda --shape llama3-8b # step `fp8ckpt`
    python benchmarks/quantized_checkpoints.py --suite w4a16 --shape llama-tiny                # a CPU dry run

The bf16 checkpoint is benchmarks/llama_shape.py's random one (std 0.02); its quantized twin is written from it on
the device, every decoder projection quantized:
- w4a16: GPTQ, 4 bits, round-to-nearest per group of 128 input channels (symmetric, GPTQModel's v1 layout).
  Goals: W4A16 / bf16 >= 2.5x at batch 1-16 and >= 1.3x at batch 64. Decode at small batch reads
  every weight once per step, so 4-bit weights (about 0.27x the bf16 bytes with scales) bound the ratio near 3.7x
  from above; the Triton GEMM's dequantization in registers and the LoRA and attention time the two engines share
  bring it down. Prompts of 512 tokens.
- fp8ckpt: `fp8` with weight_block_size [128, 128], as transformers' finegrained-fp8 quantizer writes it
  (`weight_scale_inv = amax / 448` per block, `weight / weight_scale_inv` in float8_e4m3fn), served as stored.
  Goal: FP8 / bf16 >= 1.6x at batch 64. For Llama-3-8B the projections go from 14.0 GB to 7.2 GB with
  their scales, lm_head stays 1.05 GB in bf16, 16 rank-16 adapters on the seven projections are 1.3 GB, and 64
  sequences of 128 + 32 tokens hold 1.3 GB of bf16 KV: a bound of about 1.6x, the goal itself (at 512-token
  prompts, 4.6 GB of KV: 1.48x, under the goal whatever the kernels). So its prompts are 128 tokens.
The engines run the same requests (adapters 0..15 and the base model, round robin); each batch is measured
--rounds times, the engines alternated, and the median, min and max tokens/s of each are reported with their
ratio, and the ratio of the bytes a decode step reads (weights, the batch's adapters and KV; computed from what
the engines hold, not measured): the most the ratio of times can be when both are bandwidth-bound. The goals are
written down here and measured only where a GPU ran this."""

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/ (its kernels.py)
from benchmarks import llama_shape  # noqa: E402
from benchmarks.quantization import decode_tokens_per_s, write_report  # noqa: E402
from benchmarks.work_folder import work_folder  # noqa: E402
from engine import LLM  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX, BLOCK = 448.0, 128


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] ints in [0, 16) -> [K / 8, N] int32, the first row in the lowest 4 bits (GPTQ's qweight)."""
    v = q.to(torch.int64).reshape(q.shape[0] // 8, 8, q.shape[1])
    word = sum(v[:, i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def gptq_from(weight: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit round-to-nearest of weight [out, in] per group of `group` inputs, in GPTQ v1 tensors."""
    out, inp = weight.shape
    w = weight.float().reshape(out, inp // group, group)
    scale = (w.abs().amax(-1) / 7.5).clamp(min=1e-6).half()  # [out, G]
    q = torch.round(w / scale.float()[..., None] + 8).clamp(0, 15).reshape(out, inp)
    zeros = torch.full((inp // group, out // 8), 0x77777777, dtype=torch.int32, device=weight.device)  # v1: 8 - 1
    return {"qweight": _pack_rows(q.t()).contiguous(), "qzeros": zeros, "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(inp, device=weight.device) // group).to(torch.int32)}


def fp8_blocks(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [out, in] -> weight float8_e4m3fn [out, in], weight_scale_inv [cdiv(out, 128), cdiv(in, 128)]."""
    out, inp = weight.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32, device=weight.device)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * BLOCK, cols * BLOCK)[:out, :inp]
    return {"weight": q.to(torch.float8_e4m3fn).contiguous(), "weight_scale_inv": scale}


@dataclass(frozen=True)
class Suite:
    key: str  # the quantized engine's name in the report
    label: str  # the table's heading (gpu_suite.sh prints from "## {label} checkpoint" on)
    quantize: object  # weight [out, in] -> {stored kind: tensor}
    config: dict  # quantization_config
    goals: dict  # batch -> quantized / bf16 decode tok/s
    batches: tuple[int, ...]
    prompt_len: int  # on the 8B shape


SUITES = {
    "w4a16": Suite("w4a16", "W4A16", gptq_from, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                 "desc_act": False, "sym": True, "checkpoint_format": "gptq"},
                   {1: 2.5, 16: 2.5, 64: 1.3}, (1, 16, 64), 512),
    "fp8ckpt": Suite("fp8", "FP8", fp8_blocks, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [BLOCK, BLOCK]}, {64: 1.6}, (64,), 128),
}


def write_quantized(bf16: Path, directory: Path, suite: Suite, *, device: str) -> None:
    """The suite's twin of a checkpoint: every decoder projection quantized, shard by shard, on `device`."""
    directory.mkdir(parents=True)
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        with safe_open(str(bf16 / file), framework="pt", device=device) as f:
            for name in f.keys():
                prefix, _, kind = name.rpartition(".")
                if kind == "weight" and prefix.rpartition(".")[2] in PROJECTIONS:
                    tensors.update({f"{prefix}.{k}": t.cpu() for k, t in suite.quantize(f.get_tensor(name)).items()})
                else:
                    tensors[name] = f.get_tensor(name).cpu()
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = suite.config
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for path in bf16.iterdir():
        if path.suffix not in (".safetensors", ".json") or path.name.startswith("tokenizer"):
            (directory / path.name).write_bytes(path.read_bytes())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="w4a16", choices=list(SUITES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="llama-tiny", choices=["llama3-8b", "llama-tiny"])
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (time budget)")
    parser.add_argument("--batches", type=int, nargs="+", help="default: the suite's")
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.shape == "llama3-8b" and not args.device.startswith("cuda"):
        parser.error("--shape llama3-8b needs --device cuda")
    suite = SUITES[args.suite]
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.batches = args.batches or list(suite.batches)
    args.decode_steps = args.decode_steps or (32 if args.shape == "llama3-8b" else 2)
    args.prompt_len = args.prompt_len or (suite.prompt_len if args.shape == "llama3-8b" else 16)
    return args


def shape_of(args) -> llama_shape.Shape:
    shape = llama_shape.LLAMA3_8B if args.shape == "llama3-8b" else llama_shape.TINY
    return llama_shape.Shape(**{**asdict(shape), "layers": args.layers}) if args.layers else shape


def make_llm(model_dir: Path, adapters: dict[str, str], args) -> LLM:
    batch = max(args.batches)
    context = args.prompt_len + args.decode_steps + 8
    memory = 2 * args.adapters * llama_shape.adapter_bytes(shape_of(args), 16, getattr(torch, args.dtype).itemsize)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, max_num_seqs=batch, block_size=32,
              num_kv_blocks=batch * -(-context // 32) * 2, max_num_batched_tokens=max(2048, batch * 8),
              max_adapter_rank=16, pool_adapter_bytes=memory)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def measure(args, suite: Suite, shape: llama_shape.Shape, work: Path) -> dict:
    """The checkpoints and adapters written in `work`, both engines timed: the report."""
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = getattr(torch, args.dtype)
    llama_shape.write_checkpoint(work / "bf16", shape, dtype=dtype, device=device)
    write_quantized(work / "bf16", work / suite.key, suite, device=device)
    written, _ = llama_shape.write_adapters(work, shape, list(range(args.adapters)), rank=16, dtype=dtype,
                                            device=device)
    adapters = {f"adapter{i}": path for i, (path, _) in written.items()}
    engines = {"bf16": make_llm(work / "bf16", adapters, args), suite.key: make_llm(work / suite.key, adapters, args)}
    gen = torch.Generator().manual_seed(0)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "suite": args.suite, "shape": shape.name,
              "dtype": args.dtype, "device": torch.cuda.get_device_name() if device == "cuda" else "2-core CPU container",
              "weights_bytes": {k: e.engine.memory_split()["base_weights_bytes"] for k, e in engines.items()},
              "quantization": engines[suite.key].engine.memory_split()["quantization"], "adapters": args.adapters,
              "rounds": args.rounds, "batches": {}}
    for batch in args.batches:
        prompts = [torch.randint(3, shape.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
        names = [[*adapters, None][i % (len(adapters) + 1)] for i in range(batch)]
        for llm in engines.values():  # warm up: compile, page the adapters in
            decode_tokens_per_s(llm, prompts, names, 2)
        rates = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(decode_tokens_per_s(llm, prompts, names, args.decode_steps))
        report["batches"][batch] = {name: {"median": statistics.median(r), "min": min(r), "max": max(r)}
                                    for name, r in rates.items()}
        kv = engines["bf16"].engine.memory_split()["kv_bytes_per_token"] * batch * (args.prompt_len + args.decode_steps)
        shared = kv + min(batch, args.adapters) * llama_shape.adapter_bytes(shape, 16, dtype.itemsize)
        weights = report["weights_bytes"]
        report["batches"][batch]["bound"] = (weights["bf16"] + shared) / (weights[suite.key] + shared)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    suite, shape = SUITES[args.suite], shape_of(args)
    with work_folder(f"quilt-{args.suite}-") as work:  # 8B: 16 GB of bf16 and the quantized copy
        report = measure(args, suite, shape, work)
    write_report(report, table(report, suite), args.json)
    return 0


def table(report: dict, suite: Suite) -> list[str]:
    w = report["weights_bytes"]
    lines = [f"## {suite.label} checkpoint ({report['quantization']}) vs {report['dtype']}: {report['shape']}, "
             f"{report['device']}; weights {w[suite.key] / 2**20:.1f} MiB vs {w['bf16'] / 2**20:.1f} MiB, "
             f"median of {report['rounds']} rounds",
             f"| batch | adapters | {report['dtype']} tok/s (min-max) | {suite.label} tok/s (min-max) | ratio | goal "
             f"| bytes-read bound (computed) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, r in report["batches"].items():
        b, q = r["bf16"], r[suite.key]
        goal = f">= {suite.goals[batch]}" if batch in suite.goals else "none"
        lines.append(f"| {batch} | {min(batch, report['adapters'])} | {b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f}) "
                     f"| {q['median']:.1f} ({q['min']:.1f}-{q['max']:.1f}) | {q['median'] / b['median']:.2f} "
                     f"| {goal} | {r['bound']:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
