"""An FP8 checkpoint (quant_method fp8, weight_block_size [128, 128], served as stored) against its bf16 original,
side by side in one process: decode tokens/s at batch 64 with 16 distinct adapters, and the weight bytes each
engine holds.

    python benchmarks/fp8_checkpoint.py --device cuda --shape llama3-8b   # the GPU suite's `fp8ckpt` step
    python benchmarks/fp8_checkpoint.py --shape llama-tiny                # its CPU dry run

The bf16 checkpoint is benchmarks/llama_shape.py's random one (std 0.02); its FP8 twin is written from it on the
device, each decoder projection quantized per 128 x 128 block as transformers' finegrained-fp8 quantizer does
(`weight_scale_inv = amax / 448` per block, `weight / weight_scale_inv` in float8_e4m3fn). The engines run the same
requests (adapters 0..15 and the base model, round robin); each batch is measured --rounds times, the engines
alternated, and the median, min and max tokens/s of each are reported with their ratio. Goal of issue 36 (written
down here, measured only where a GPU ran this): FP8 / bf16 >= 1.6x at batch 64. A decode step at batch 64 reads
every weight once, the 16 adapters and every sequence's KV: the table prints the ratio of those bytes (computed
from what the engines hold, not measured), the most the ratio of times can be when both are bandwidth-bound. For
Llama-3-8B the projections go from 14.0 GB to 7.2 GB with their scales, lm_head stays 1.05 GB in bf16 (and the
embedding table, of which a step reads 64 rows), 16 rank-16 adapters on the seven projections are 1.3 GB, and 64
sequences of 128 + 32 tokens hold 1.3 GB of bf16 KV: a bound of about 1.6x, the goal itself (at 512-token prompts,
4.6 GB of KV: 1.48x, under the goal whatever the kernels). So the default prompts are 128 tokens; the LoRA and
attention time both engines share bring the measured ratio below the bound."""

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/ (its kernels.py)
from benchmarks import llama_shape  # noqa: E402
from benchmarks.quantization import decode_tokens_per_s  # noqa: E402
from engine import LLM  # noqa: E402

GOALS = {64: 1.6}  # FP8 / bf16 decode tok/s, issue 36
BLOCK = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn [out, in], weight_scale_inv [cdiv(out, 128), cdiv(in, 128)] float32)."""
    out, inp = weight.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32, device=weight.device)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * BLOCK, cols * BLOCK)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def write_fp8(bf16: Path, directory: Path, *, device: str) -> None:
    """The FP8 block twin of a checkpoint: every decoder projection quantized, shard by shard, on `device`."""
    directory.mkdir(parents=True)
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        with safe_open(str(bf16 / file), framework="pt", device=device) as f:
            for name in f.keys():
                prefix, _, kind = name.rpartition(".")
                if kind == "weight" and prefix.rpartition(".")[2] in PROJECTIONS:
                    q, scale = fp8_blocks(f.get_tensor(name))
                    tensors[name], tensors[f"{prefix}.weight_scale_inv"] = q.cpu(), scale.cpu()
                    weight_map[f"{prefix}.weight_scale_inv"] = file
                else:
                    tensors[name] = f.get_tensor(name).cpu()
                weight_map[name] = file
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for path in bf16.iterdir():
        if path.suffix not in (".safetensors", ".json") or path.name.startswith("tokenizer"):
            (directory / path.name).write_bytes(path.read_bytes())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="llama-tiny", choices=["llama3-8b", "llama-tiny"])
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (time budget)")
    parser.add_argument("--batches", type=int, nargs="+", default=[64])
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.shape == "llama3-8b" and not args.device.startswith("cuda"):
        parser.error("--shape llama3-8b needs --device cuda")
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.decode_steps = args.decode_steps or (32 if args.shape == "llama3-8b" else 2)
    args.prompt_len = args.prompt_len or (128 if args.shape == "llama3-8b" else 16)
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
              max_adapter_rank=16, adapter_memory_bytes=memory)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    work, shape = Path(tempfile.mkdtemp(prefix="quilt-fp8-")), shape_of(args)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = getattr(torch, args.dtype)
    llama_shape.write_checkpoint(work / "bf16", shape, dtype=dtype, device=device)
    write_fp8(work / "bf16", work / "fp8", device=device)
    written, _ = llama_shape.write_adapters(work, shape, list(range(args.adapters)), rank=16, dtype=dtype,
                                            device=device)
    adapters = {f"adapter{i}": path for i, (path, _) in written.items()}
    engines = {"bf16": make_llm(work / "bf16", adapters, args), "fp8": make_llm(work / "fp8", adapters, args)}
    gen = torch.Generator().manual_seed(0)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "shape": shape.name, "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if device == "cuda" else "2-core CPU container",
              "weights_bytes": {k: e.engine.memory_split()["base_weights_bytes"] for k, e in engines.items()},
              "quantization": engines["fp8"].engine.memory_split()["quantization"], "adapters": args.adapters,
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
        report["batches"][batch]["bound"] = (w_bytes(report, "bf16") + shared) / (w_bytes(report, "fp8") + shared)
    lines = table(report)
    report["table"] = lines
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


def w_bytes(report: dict, engine: str) -> int:
    return report["weights_bytes"][engine]


def table(report: dict) -> list[str]:
    w = report["weights_bytes"]
    lines = [f"## FP8 checkpoint ({report['quantization']}) vs {report['dtype']}: {report['shape']}, "
             f"{report['device']}; weights {w['fp8'] / 2**20:.1f} MiB vs {w['bf16'] / 2**20:.1f} MiB, "
             f"median of {report['rounds']} rounds",
             f"| batch | adapters | {report['dtype']} tok/s (min-max) | FP8 tok/s (min-max) | ratio | goal "
             f"| bytes-read bound (computed) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, r in report["batches"].items():
        b, q = r["bf16"], r["fp8"]
        lines.append(f"| {batch} | {min(batch, report['adapters'])} | {b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f}) "
                     f"| {q['median']:.1f} ({q['min']:.1f}-{q['max']:.1f}) | {q['median'] / b['median']:.2f} "
                     f"| >= {GOALS.get(batch, 1.0)} | {r['bound']:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
