"""Quantized against unquantized engines, side by side in one process: memory, decode throughput, agreement.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.quantization [--shape small] [--configs int8 fp8 kv-fp8 fp8+kv-fp8]
    python benchmarks/quantization.py --device cuda --shape llama3-8b      # the GPU suite's `quant` step

For each configuration against the unquantized engine (same checkpoint, same adapters, same requests):
- memory: base weights (served / unquantized), KV bytes per token, and the KV tokens that the same memory
  holds (LLMEngine.memory_split(): the pool plus the weights saved, in each engine's own dtype);
- decode throughput: tokens/s of pure decode steps at batch --batch (adapters mixed), engines alternated
  --rounds times, medians;
- agreement: the quantized engine generates --tokens tokens greedily (mixed adapters, its decode path);
  the unquantized engine scores the same sequences teacher-forced (prompt_logprobs): the share of positions
  where its top-1 token is the one the quantized engine chose, and mean |delta log-probability| of that token.

CPU shapes are random transformers checkpoints with PEFT adapters (initializer_range 0.15, so logits are not
flat); llama3-8b is benchmarks/llama_shape.py's random bf16 checkpoint (std 0.02: on random weights many
positions are near-ties, which lowers agreement; the table says so).
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/ (its kernels.py)
from benchmarks.work_folder import work_folder  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

CONFIGS = {  # name -> (quantization, kv_cache_dtype)
    "int8": ("int8", "auto"),
    "fp8": ("fp8", "auto"),
    "kv-fp8": (None, "fp8"),
    "fp8+kv-fp8": ("fp8", "fp8"),
}
DECISIVE_GAP = 0.1  # nats between the reference's top-2 tokens (the gap benchmarks/gpu_trace.py counts too)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def agreement(reference: LLM, quantized: LLM, prompts: list[list[int]], adapters: list[str | None],
              max_tokens: int, decisive_gap: float = DECISIVE_GAP) -> dict:
    """Greedy top-1 agreement of `quantized` with `reference` over the tokens `quantized` generates (see the
    module docstring), mean |delta log-probability| of the generated tokens, and the agreement at the decisive
    positions: those where the reference's top-2 log-probabilities are more than `decisive_gap` apart."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    generated = quantized.generate(prompts, greedy, adapters=adapters)
    sequences = [p + o.token_ids for p, o in zip(prompts, generated, strict=True)]
    score = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    scored = reference.generate(sequences, score, adapters=adapters)
    agree = decisive = decisive_agree = 0
    deltas = []
    for prompt, gen, ref in zip(prompts, generated, scored, strict=True):
        for i, (token, mine) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
            theirs = ref.prompt_logprobs[len(prompt) + i]
            assert theirs.token_id == token == mine.token_id
            (top, first), (_, second) = sorted(theirs.top.items(), key=lambda kv: -kv[1])[:2]
            agree += top == token
            if first - second > decisive_gap:
                decisive += 1
                decisive_agree += top == token
            deltas.append(abs(mine.logprob - theirs.logprob))
    return {"tokens": len(deltas), "agreement": agree / len(deltas), "mean_abs_dlogprob": sum(deltas) / len(deltas),
            "max_abs_dlogprob": max(deltas), "decisive_tokens": decisive,
            "decisive_agreement": decisive_agree / max(decisive, 1)}


def train_peaked(base_dir: Path, directory: Path, *, steps: int = 300, seed: int = 0) -> Path:
    """`base_dir`'s model trained briefly on a synthetic bigram chain (each token has three successors, with
    probabilities 0.6, 0.25, 0.15), saved to `directory` with its tokenizer files: a model whose next-token
    distributions are peaked the way a trained LM's are, unlike a random checkpoint's near-flat ones (on which
    a top-1 comparison mostly counts near-ties)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).train()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(6, vocab, (vocab, 3), generator=gen)  # [vocab, 3]
    probs = torch.tensor([0.6, 0.25, 0.15])
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(steps):
        tokens = torch.empty(32, 32, dtype=torch.long)  # [batch, length]
        tokens[:, 0] = torch.randint(6, vocab, (32,), generator=gen)
        for t in range(1, tokens.shape[1]):
            tokens[:, t] = successors[tokens[:, t - 1], torch.multinomial(probs, 32, replacement=True, generator=gen)]
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(base_dir) / name).exists():
            (Path(directory) / name).write_bytes((Path(base_dir) / name).read_bytes())
    return Path(directory)


def build_cpu_checkpoint(root: Path, *, hidden: int, layers: int, num_adapters: int,
                         train_steps: int) -> tuple[Path, dict[str, Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 16 * 16, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), vocab_size=1024,
                         max_position_embeddings=1024, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    if train_steps:
        train_peaked(root / "base", root / "base", steps=train_steps)
    adapter_dirs = {}
    for i in range(num_adapters):
        model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                               LoraConfig(r=[8, 16, 4][i % 3], lora_alpha=16, target_modules=ALL_TARGETS))
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                torch.nn.init.normal_(param, std=0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.2)
        model.save_pretrained(root / f"adapter{i}")
        adapter_dirs[f"adapter{i}"] = root / f"adapter{i}"
    return root / "base", adapter_dirs


def llama_shape_of(args):
    """The benchmarks/llama_shape.py shape of --shape llama3-8b (or llama-tiny, its CPU dry run), --layers applied."""
    from dataclasses import asdict

    from benchmarks import llama_shape

    shape = llama_shape.LLAMA3_8B if args.shape == "llama3-8b" else llama_shape.TINY
    if args.layers:
        shape = llama_shape.Shape(**{**asdict(shape), "layers": args.layers, "name": f"{shape.name}-{args.layers}L"})
    return shape


def build_shape_checkpoint(root: Path, args) -> tuple[Path, dict[str, Path]]:
    """A llama_shape checkpoint of random weights (std 0.02) and rank-16 adapters on all seven projections."""
    from benchmarks import llama_shape

    shape, dtype = llama_shape_of(args), getattr(torch, args.dtype)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    written = llama_shape.write_checkpoint(root / "base", shape, dtype=dtype, device=device)
    print(f"checkpoint {shape.name}: {written['bytes'] / 1e9:.2f} GB in {written['seconds']:.1f} s", flush=True)
    adapters, _ = llama_shape.write_adapters(root, shape, list(range(args.adapters)), rank=16, dtype=dtype,
                                             device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
    return root / "base", {f"adapter{i}": Path(path) for i, (path, _) in adapters.items()}


def make_llm(base: Path, adapter_dirs: dict[str, Path], args, quantization: str | None, kv_cache_dtype: str) -> LLM:
    llm = LLM(base, device=args.device, dtype=args.dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              block_size=args.block_size, num_kv_blocks=args.kv_blocks, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch * 8), max_adapter_rank=16,
              pool_adapter_bytes=args.pool_adapter_bytes)
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    return llm


def decode_tokens_per_s(llm: LLM, prompts: list[list[int]], adapters: list[str | None], steps: int) -> float:
    """Tokens/s of `steps` pure decode steps, all prompts already in, at batch len(prompts)."""
    engine, names = llm.engine, llm.adapters
    sampling = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    tag = f"decode-{time.monotonic_ns()}"
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, sampling, adapter=names.get(adapter))
    scheduler = engine.scheduler
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in [*scheduler.running, *scheduler.waiting]):
        engine.step()
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return tokens / elapsed


def workload(args, names: list[str]) -> tuple[list[list[int]], list[str | None]]:
    rng = random.Random(0)
    lengths = [rng.randint(8, args.prompt_len) for _ in range(args.batch)]
    prompts = [[rng.randrange(3, args.vocab) for _ in range(n)] for n in lengths]
    choices = [None, *names]
    return prompts, [choices[i % len(choices)] for i in range(args.batch)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="small", choices=["tiny", "small", "llama3-8b", "llama-tiny"],
                        help="tiny, small: transformers + PEFT checkpoints; llama3-8b (CUDA), llama-tiny (its dry "
                             "run): benchmarks/llama_shape.py's")
    parser.add_argument("--layers", type=int, help="llama3-8b: fewer layers than 32 (time budget)")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=None, help="decode batch (default 32; tiny 8)")
    parser.add_argument("--tokens", type=int, default=2000, help="generated tokens scored for agreement")
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=0,
                        help="CPU shapes: train the random checkpoint this many steps first (train_peaked)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    gpu = args.shape in ("llama3-8b", "llama-tiny")
    if args.shape == "llama3-8b" and not args.device.startswith("cuda"):
        parser.error("--shape llama3-8b needs --device cuda")
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.configs = args.configs or (["fp8", "kv-fp8", "fp8+kv-fp8", "int8"] if gpu else list(CONFIGS))
    args.batch = args.batch or (8 if args.shape == "tiny" else 32)
    args.decode_steps = args.decode_steps or (8 if args.shape == "tiny" else 32)
    args.prompt_len = args.prompt_len or (512 if args.shape == "llama3-8b" else 64)
    args.block_size = 32  # fp8 KV: a chunk holds half (bf16) or a quarter (fp32) of the values it holds otherwise
    context = args.prompt_len + max(args.decode_steps, args.tokens // args.batch) + 8
    args.kv_blocks = args.batch * -(-context // args.block_size) * 2
    args.pool_adapter_bytes = None
    if gpu:
        from benchmarks import llama_shape

        itemsize = getattr(torch, args.dtype).itemsize
        args.pool_adapter_bytes = 2 * args.adapters * llama_shape.adapter_bytes(llama_shape_of(args), 16, itemsize)
        args.vocab = llama_shape_of(args).vocab
    else:
        args.vocab = 1024
    return args


def measure(args, work: Path) -> dict:
    """The checkpoint and adapters written in `work`, each configuration against the unquantized engine."""
    if args.shape in ("llama3-8b", "llama-tiny"):
        base, adapter_dirs = build_shape_checkpoint(work, args)
    else:
        hidden, layers = (64, 2) if args.shape == "tiny" else (256, 4)
        base, adapter_dirs = build_cpu_checkpoint(work, hidden=hidden, layers=layers, num_adapters=args.adapters,
                                                  train_steps=args.train_steps)
    prompts, adapters = workload(args, list(adapter_dirs))
    reference = make_llm(base, adapter_dirs, args, None, "auto")
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "shape": args.shape + (f" ({args.layers} layers)" if args.layers else "")
              + (f", trained {args.train_steps} steps" if args.train_steps else ", random weights"),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "2-core CPU container",
              "dtype": args.dtype, "batch": args.batch, "reference": reference.engine.memory_split(), "configs": {},
              "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if args.device != "cpu" else None}
    per_request = -(-args.tokens // args.batch)
    for name in args.configs:
        quantization, kv_cache_dtype = CONFIGS[name]
        llm = make_llm(base, adapter_dirs, args, quantization, kv_cache_dtype)
        decode_tokens_per_s(llm, prompts[:2], adapters[:2], 2)  # warm up
        decode_tokens_per_s(reference, prompts[:2], adapters[:2], 2)
        ref_rates, rates = [], []
        for _ in range(args.rounds):
            ref_rates.append(decode_tokens_per_s(reference, prompts, adapters, args.decode_steps))
            rates.append(decode_tokens_per_s(llm, prompts, adapters, args.decode_steps))
        agree = agreement(reference, llm, prompts, adapters, per_request)
        memory = llm.engine.memory_split()
        report["configs"][name] = {"memory": memory, "decode_tok_s": statistics.median(rates),
                                   "reference_decode_tok_s": statistics.median(ref_rates), **agree}
        del llm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    with work_folder("quilt-quant-") as work:  # 8B: 16 GB of bf16 weights
        report = measure(args, work)
    write_report(report, table(report), args.json)
    return 0


def write_report(report: dict, lines: list[str], path: Path | None) -> None:
    """Print a benchmark's table, keep it in its report, and write the report as JSON to `path` when given."""
    report["table"] = lines
    print("\n".join(lines))
    if path:
        path.write_text(json.dumps(report, indent=1, default=str))


def table(report: dict) -> list[str]:
    ref = report["reference"]
    mib = 1 << 20
    lines = [f"## quantization: {report['shape']}, {report['dtype']}, {report['device']}, "
             f"decode batch {report['batch']}",
             "| config | weights MiB (unquantized) | KV bytes/token (unquantized) | KV tokens in the same memory "
             "(unquantized) | decode tok/s (unquantized) | ratio | top-1 agreement | tokens | mean abs dlogprob "
             "| agreement where the top-2 gap > 0.1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["configs"].items():
        m = r["memory"]
        lines.append(
            f"| {name} | {m['base_weights_bytes'] / mib:.1f} ({ref['base_weights_bytes'] / mib:.1f}) "
            f"| {m['kv_bytes_per_token']:.0f} ({m['kv_bytes_per_token_full_precision']:.0f}) "
            f"| {m['kv_capacity_tokens']} ({m['kv_capacity_tokens_full_precision']}) "
            f"| {r['decode_tok_s']:.0f} ({r['reference_decode_tok_s']:.0f}) "
            f"| {r['decode_tok_s'] / r['reference_decode_tok_s']:.2f} | {r['agreement']:.2%} | {r['tokens']} "
            f"| {r['mean_abs_dlogprob']:.4f} | {r['decisive_agreement']:.2%} of {r['decisive_tokens']} |")
    total = report.get("device_memory_bytes")
    if total:  # arithmetic on the bytes measured above, not a measurement
        lines.append(f"KV tokens that 90% of this GPU's {total / 2**30:.0f} GiB holds after the weights (computed):")
        fit = [f"unquantized {int((0.9 * total - ref['base_weights_bytes']) // ref['kv_bytes_per_token'])}"]
        for name, r in report["configs"].items():
            m = r["memory"]
            fit.append(f"{name} {int((0.9 * total - m['base_weights_bytes']) // m['kv_bytes_per_token'])}")
        lines.append(", ".join(fit))
    return lines


if __name__ == "__main__":
    sys.exit(main())
