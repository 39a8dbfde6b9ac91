"""Kernel benchmark: achieved bandwidth vs the device's copy bandwidth, and speedup over plain PyTorch.

    python benchmarks/kernels.py                 # on a CUDA GPU: Llama-3-8B shapes, bf16
    python benchmarks/kernels.py --only lora     # a subset (lora, lora_delta_configs, attention, moe, store_kv,
                                                 # rms_norm, rotary, silu, gelu, wna16, fp8_block); moe:
                                                 # Qwen3-30B-A3B's experts (grouped_matmul, expert_lora);
                                                 # lora_delta_configs: lora_delta's candidate configurations side
                                                 # by side (kernel_lora_configs.py); wna16, fp8_block: the quantized
                                                 # checkpoints' GEMMs at decode shapes against torch's bf16 matmul
                                                 # (kernel_quantized.py)
    python benchmarks/kernels.py --smoke         # no GPU: tiny shapes in Triton's interpreter (checks wiring only)

For each op and shape: the Triton time (triton.testing.do_bench, median), the bytes the op must
move at least (inputs read once, outputs written once), that bandwidth as a fraction of a
device-to-device copy measured in the same run, the plain-PyTorch baseline's time (gather adapter
weights + bmm for LoRA, gather blocks + scaled_dot_product_attention for attention, a matmul per expert
for grouped_matmul, the references otherwise) and the speedup; `ok` says the two outputs agreed.
"""

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_lora import lora_rows  # noqa: E402
from benchmarks.kernel_lora_configs import lora_config_rows  # noqa: E402
from benchmarks.kernel_quantized import quantized_rows  # noqa: E402
from benchmarks.kernel_rows import Row, copy_bandwidth, measure  # noqa: E402

LLAMA3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 14336, "block": 16}
TINY = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 384, "block": 16}
QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}  # its experts (moe)
TINY_MOE = {"hidden": 64, "inter": 48, "experts": 8, "top_k": 2}
GRID = {
    "batches": (1, 16, 64, 256), "adapters": (1, 16, 64), "ranks": (8, 16, 64), "contexts": (512, 2048, 8192),
    "prefill": ((1, 2048, 2048), (4, 512, 2048), (16, 128, 1024)), "tokens": (1, 16, 64, 256, 4096),
    # (batch, new tokens (1: decode), context, window, softcap): Mistral/Gemma-style windows, Gemma 2's soft-cap
    "windowed": ((16, 1, 8192, 1024, None), (64, 1, 2048, None, 50.0), (1, 1024, 8192, 1024, None)),
    "moe_tokens": (1, 16, 64, 512),
}  # fmt: skip
SMOKE_GRID = {
    "batches": (1, 4), "adapters": (1, 2), "ranks": (8,), "contexts": (40, 100),
    "prefill": ((1, 32, 32), (2, 16, 48)), "tokens": (1, 5),
    "windowed": ((4, 1, 100, 24, None), (2, 1, 40, None, 5.0), (1, 20, 100, 24, 5.0)),
    "moe_tokens": (1, 6),
}  # fmt: skip


def paged_cache(cfg, batch, context, device, dtype):
    blocks_per_seq = -(-context // cfg["block"])
    shape = (batch * blocks_per_seq, cfg["block"], cfg["kv_heads"], cfg["head_dim"])
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def sdpa_over_gathered(q, k_cache, v_cache, tables, context, mask=None):
    """Baseline: gather every sequence's blocks, then scaled_dot_product_attention. q [B, H, Tq, D]."""
    keys = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)  # [B, kvh, L, D]
    values = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def attention_rows(cfg, grid, device, dtype, ops) -> list[Row]:
    rows = []
    for context in grid["contexts"]:
        for batch in grid["batches"]:
            rows.append(decode_case(cfg, ops, batch, context, device, dtype))
    for batch, new, context in grid["prefill"]:
        rows.append(prefill_case(cfg, ops, batch, new, context, device, dtype))
    for case in grid["windowed"]:
        rows.append(windowed_case(cfg, ops, *case, device, dtype))
    return rows


def windowed_case(cfg, ops, batch, new, context, window, softcap, device, dtype) -> Row:
    """Decode (new = 1) or prefill after a cached prefix, with a sliding window and/or a soft-cap: the
    window's blocks alone are read (compare with the full-context row of the same shape); the baseline
    gathers every block and masks."""
    es = torch.tensor([], dtype=dtype).element_size()
    heads, kv_heads, head_dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    k_cache, v_cache, tables, lens = paged_cache(cfg, batch, context, device, dtype)
    q = torch.randn(batch * new, heads, head_dim, device=device, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    q_pos = torch.arange(context - new, context, device=device)[:, None]
    key_pos = torch.arange(context, device=device)[None, :]
    visible = (key_pos <= q_pos) & (key_pos > q_pos - (window or context + 1))  # [new, context]
    seen = int(visible.sum())  # (query, key) pairs

    def baseline():
        keys = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).float()  # [B, kvh, L, D]
        values = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).float()
        qb = q.view(batch, new, kv_heads, heads // kv_heads, head_dim).permute(0, 2, 3, 1, 4).float()  # [B,kvh,G,n,D]
        scores = qb @ keys[:, :, None].transpose(-1, -2) * scale  # [B, kvh, G, new, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = probs @ values[:, :, None]  # [B, kvh, G, new, D]
        return out.permute(0, 3, 1, 2, 4).reshape(batch * new, heads, head_dim).to(dtype)

    if new == 1:
        name, run = "paged_attention_decode", lambda: ops.paged_attention_decode(
            q, k_cache, v_cache, tables, lens, scale, window=window, softcap=softcap)
    else:
        cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
        name, run = "paged_attention_prefill", lambda: ops.paged_attention_prefill(
            q, k_cache, v_cache, cu, tables, lens, scale, window=window, softcap=softcap)
    read = min(context, (window or context) + new - 1)  # keys some query of a sequence sees
    extra = (f" window={window}" if window else "") + (f" softcap={softcap:g}" if softcap else "")
    return measure(
        name, f"B={batch}{f' new={new}' if new > 1 else ''} ctx={context}{extra}", run, baseline,
        (2 * batch * read * kv_heads * head_dim + 2 * batch * new * heads * head_dim) * es,
        flops=4 * batch * heads * head_dim * seen,
    )  # fmt: skip


def decode_case(cfg, ops, batch, context, device, dtype) -> Row:
    es = torch.tensor([], dtype=dtype).element_size()
    heads, kv_heads, head_dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    k_cache, v_cache, tables, lens = paged_cache(cfg, batch, context, device, dtype)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    return measure(
        "paged_attention_decode", f"B={batch} ctx={context}",
        lambda: ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale),
        lambda: sdpa_over_gathered(q[:, :, None], k_cache, v_cache, tables, context)[:, :, 0],
        (2 * batch * context * kv_heads * head_dim + 2 * batch * heads * head_dim) * es,
        flops=4 * batch * heads * context * head_dim,
    )  # fmt: skip


def prefill_case(cfg, ops, batch, new, context, device, dtype) -> Row:
    """`batch` sequences of `new` tokens each, after a cached prefix of context - new tokens."""
    es = torch.tensor([], dtype=dtype).element_size()
    heads, kv_heads, head_dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    k_cache, v_cache, tables, lens = paged_cache(cfg, batch, context, device, dtype)
    q = torch.randn(batch * new, heads, head_dim, device=device, dtype=dtype)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
    positions = torch.arange(context, device=device)
    causal = positions[None, :] <= positions[context - new :, None]  # [new, context]
    qb = q.view(batch, new, heads, head_dim).transpose(1, 2)  # [B, H, new, D]
    scale = 1 / math.sqrt(head_dim)
    pairs = new * (context - new) + new * (new + 1) / 2
    return measure(
        "paged_attention_prefill", f"B={batch} new={new} ctx={context}",
        lambda: ops.paged_attention_prefill(q, k_cache, v_cache, cu, tables, lens, scale),
        lambda: sdpa_over_gathered(qb, k_cache, v_cache, tables, context, causal).transpose(1, 2).flatten(0, 1),
        (2 * batch * context * kv_heads * head_dim + 2 * batch * new * heads * head_dim) * es,
        flops=4 * batch * heads * head_dim * pairs,
    )  # fmt: skip


def moe_rows(cfg, grid, device, dtype, ops) -> list[Row]:
    """The experts of one MoE layer: grouped_matmul over gate_up and down for T tokens routed top-k (uniformly at
    random), and expert_lora on gate_up for 4 adapters of rank 16 per expert, each token one of them."""
    hidden, inter, experts = cfg["hidden"], cfg["inter"], cfg["experts"]
    weights = {"gate_up": torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) / hidden**0.5,
               "down": torch.randn(experts, hidden, inter, device=device, dtype=dtype) / inter**0.5}
    rows = []
    for tokens in grid["moe_tokens"]:
        rows += moe_cases(cfg, ops, tokens, weights, device, dtype)
    return rows


def moe_cases(cfg, ops, tokens, weights, device, dtype) -> list[Row]:
    from kernels import reference

    es = torch.tensor([], dtype=dtype).element_size()
    hidden, inter, experts, top_k = (cfg[k] for k in ("hidden", "inter", "experts", "top_k"))
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices.flatten().sort().values
    counts = torch.bincount(ids, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    hit, n = int((counts > 0).sum()), tokens * top_k
    rows = []
    for name, weight in weights.items():
        _, out_dim, in_dim = weight.shape
        x = torch.randn(n, in_dim, device=device, dtype=dtype)
        rows.append(measure(
            f"grouped_matmul {name}", f"T={tokens} k={top_k} E={experts}",
            lambda x=x, w=weight: ops.grouped_matmul(x, w, offsets),
            lambda x=x, w=weight: reference.grouped_matmul(x, w, offsets),
            (hit * out_dim * in_dim + n * (in_dim + out_dim)) * es, flops=2.0 * n * in_dim * out_dim,
        ))  # fmt: skip
    rank, used = 16, 4
    table = torch.arange(used * experts * rank, device=device).view(used, experts, rank)
    pages = torch.randn(used * experts * rank * (hidden + 2 * inter), device=device, dtype=dtype) * 0.1
    a_rows = table * hidden  # A rows first, then B^T rows of gate, then of up
    b_rows = torch.stack([used * experts * rank * hidden + table * inter,
                          used * experts * rank * (hidden + inter) + table * inter])
    slots = torch.randint(0, used, (n,), device=device, dtype=torch.int32)
    ranks = torch.full((used,), rank, dtype=torch.int32, device=device)
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    y = torch.zeros(n, 2 * inter, device=device, dtype=dtype)
    args = (x, pages, a_rows, b_rows, slots, ids, ranks, torch.ones(used, device=device), (0, inter, 2 * inter))
    pairs = len(set(zip(slots.tolist(), ids.tolist(), strict=True)))
    rows.append(measure(
        "expert_lora gate_up", f"T={tokens} k={top_k} E={experts} U={used} r={rank}",
        lambda: ops.expert_lora(y, *args), lambda: reference.expert_lora(y, *args),
        (pairs * rank * (hidden + 2 * inter) + n * (hidden + 4 * inter)) * es,
        out=lambda: _added(ops.expert_lora, y, args), base_out=lambda: _added(reference.expert_lora, y, args),
    ))  # fmt: skip
    return rows


def _added(op, y, args) -> torch.Tensor:
    y.zero_()
    op(y, *args)
    return y.clone()


def pointwise_rows(cfg, grid, device, dtype, ops, only) -> list[Row]:
    rows = []
    for tokens in grid["tokens"]:
        rows += pointwise_cases(cfg, ops, tokens, device, dtype, only)
    return rows


def pointwise_cases(cfg, ops, tokens, device, dtype, only) -> list[Row]:
    from kernels import reference

    es = torch.tensor([], dtype=dtype).element_size()
    hidden, inter, kv_heads, heads, head_dim = (cfg[k] for k in ("hidden", "inter", "kv_heads", "heads", "head_dim"))
    rows = []
    if "rms_norm" in only:
        x, res = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
        w = torch.randn(hidden, device=device, dtype=dtype)
        rows.append(measure(
            "rms_norm+residual", f"T={tokens} hidden={hidden}", lambda: ops.rms_norm(x, w, 1e-5, res)[0],
            lambda: reference.rms_norm(x, w, 1e-5, res)[0], 4 * tokens * hidden * es + hidden * es,
        ))  # fmt: skip
    if "silu" in only:
        gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
        rows.append(measure("silu_and_mul", f"T={tokens} inter={inter}", lambda: ops.silu_and_mul(gate_up),
                            lambda: reference.silu_and_mul(gate_up), 3 * tokens * inter * es))  # fmt: skip
    if "gelu" in only:
        gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
        rows.append(measure("gelu_tanh_and_mul", f"T={tokens} inter={inter}", lambda: ops.gelu_tanh_and_mul(gate_up),
                            lambda: reference.gelu_tanh_and_mul(gate_up), 3 * tokens * inter * es))  # fmt: skip
    if "rotary" in only:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # fmt: skip
        cache = reference.rope_cos_sin_cache(head_dim, 8192, 500000.0, scaling).to(device)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        q0 = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
        k0 = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
        q, k = q0.clone(), k0.clone()

        def rotated(fn):
            q.copy_(q0)
            k.copy_(k0)
            fn(pos, q, k, cache)
            return torch.cat((q.flatten(1), k.flatten(1)), dim=1)

        rows.append(measure(
            "rotary_embedding", f"T={tokens}", lambda: ops.rotary_embedding(pos, q, k, cache),
            lambda: reference.rotary_embedding(pos, q, k, cache),
            2 * tokens * (heads + kv_heads) * head_dim * es + tokens * head_dim * 4,
            out=lambda: rotated(ops.rotary_embedding), base_out=lambda: rotated(reference.rotary_embedding),
        ))  # fmt: skip
    if "store_kv" in only:
        k, v = (torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        k_cache, v_cache, _, _ = paged_cache(cfg, 1, max(tokens, 16) * 4, device, dtype)
        slots = torch.randperm(k_cache.shape[0] * cfg["block"], device=device)[:tokens]

        def stored(fn):
            k_cache.zero_()
            fn(k, v, k_cache, v_cache, slots)
            return k_cache.view(-1, kv_heads, head_dim)[slots]

        rows.append(measure(
            "store_kv", f"T={tokens}", lambda: ops.store_kv(k, v, k_cache, v_cache, slots),
            lambda: reference.store_kv(k, v, k_cache, v_cache, slots), 4 * tokens * kv_heads * head_dim * es,
            out=lambda: stored(ops.store_kv), base_out=lambda: stored(reference.store_kv),
        ))  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's CPU interpreter")
    parser.add_argument("--only", nargs="*",
                        default=["lora", "lora_delta_configs", "attention", "moe", "store_kv", "rms_norm", "rotary",
                                 "silu", "gelu", "wna16", "fp8_block"])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/kernels.py needs a CUDA GPU (Triton kernels, do_bench timings). "
              "Use --smoke to check the wiring on tiny shapes in Triton's CPU interpreter.", file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke:
        from kernels import interpreter

        interpreter.enable()
    import kernels

    ops = _TritonOps(kernels)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    cfg, grid = (TINY, SMOKE_GRID) if args.smoke else (LLAMA3_8B, GRID)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    peak = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter; timings meaningless)"
    print(f"device: {name}; copy bandwidth {peak / 1e9:.0f} GB/s; dtype {dtype}; torch {torch.__version__}")
    rows, config_rows = [], []
    with torch.no_grad():
        if "lora_delta_configs" in args.only:  # its own table, printed as it goes
            config_rows = lora_config_rows(cfg, device, dtype, ops, smoke=args.smoke)
        if {"wna16", "fp8_block"} & set(args.only):  # its own table, printed as it goes
            config_rows += quantized_rows(cfg, device, dtype, set(args.only), smoke=args.smoke)
        if "lora" in args.only:
            rows += lora_rows(cfg, grid, device, dtype, ops)
        if "attention" in args.only:
            rows += attention_rows(cfg, grid, device, dtype, ops)
        if "moe" in args.only:
            rows += moe_rows(TINY_MOE if args.smoke else QWEN3_30B_A3B, grid, device, dtype, ops)
        rows += pointwise_rows(cfg, grid, device, dtype, ops, set(args.only))
    print("| op | shape | triton µs | GB/s | % copy BW | TFLOP/s | torch µs | speedup | ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        gbs = r.min_bytes / (r.triton_us * 1e-6) / 1e9
        tflops = f"{r.flops / (r.triton_us * 1e-6) / 1e12:.1f}" if r.flops else ""
        print(f"| {r.op} | {r.shape} | {r.triton_us:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / peak:.0f}% | {tflops} "
              f"| {r.baseline_us:.1f} | {r.baseline_us / r.triton_us:.2f}x | {'yes' if r.ok else 'NO'} |")  # fmt: skip
    for line in goal_lines(rows, peak):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "copy_bandwidth": peak,
                                         "rows": [asdict(r) for r in rows + config_rows]}))
    return 0 if all(r.ok for r in rows + config_rows) else 1


def goal_lines(rows: list[Row], peak: float) -> list[str]:
    """The issue's targets: LoRA >= 70% of copy bandwidth and >= 3x torch at T >= 64; decode >= 70% at B=64, 2k."""

    def fraction(r: Row) -> float:
        return r.min_bytes / (r.triton_us * 1e-6) / peak

    lines = []
    lora = [r for r in rows if r.op == "lora_delta" and int(r.shape.split("T=")[1].split()[0]) >= 64]
    if lora:
        worst_bw, worst_speedup = min(lora, key=fraction), min(lora, key=lambda r: r.baseline_us / r.triton_us)
        lines.append(f"goal LoRA T>=64: lowest {100 * fraction(worst_bw):.0f}% of copy bandwidth ({worst_bw.op} "
                     f"{worst_bw.shape}; target 70%), lowest speedup {worst_speedup.baseline_us / worst_speedup.triton_us:.1f}x "
                     f"({worst_speedup.op} {worst_speedup.shape}; target 3x)")  # fmt: skip
    decode = [r for r in rows if r.op == "paged_attention_decode" and r.shape == "B=64 ctx=2048"]
    if decode:
        lines.append(f"goal decode B=64 ctx=2048: {100 * fraction(decode[0]):.0f}% of copy bandwidth (target 70%)")
    return lines


class _TritonOps:
    """The Triton launchers themselves (on CPU tensors the dispatch would pick the references)."""

    def __init__(self, kernels):
        import importlib

        self.LoRAMeta = kernels.LoRAMeta
        for op in ("lora_delta", "lora_shrink", "lora_expand", "paged_attention_decode", "paged_attention_prefill", "store_kv",
                   "rms_norm", "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul", "grouped_matmul",
                   "expert_lora"):  # fmt: skip
            setattr(self, op, getattr(importlib.import_module(f"kernels.{op}"), op))


if __name__ == "__main__":
    sys.exit(main())
