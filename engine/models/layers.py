"""The layers every family composes: RMSNorm, attention over the paged KV cache, the gated MLP.

Under tensor parallelism each holds its rank's part: column-parallel qkv_proj and gate_up_proj, row-parallel
o_proj and down_proj completed by one all-reduce (engine/parallel/sharding.py)."""

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.models.linear import Linear
from engine.models.spec import ModelSpec
from engine.parallel.communicator import Communicator


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (offset 0: weight * normed, in the input dtype), or GemmaRMSNorm (offset 1:
    the checkpoint's w is held as 1 + w in float32 and the product taken in float32, then cast back)."""

    def __init__(self, size: int, eps: float, *, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32 if offset else None), requires_grad=False)

    def load_weight(self, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(tensor.float() + self.offset if self.offset else tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.offset:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        assert residual is None, "an offset norm takes its residual added by the layer"
        return kernels.rms_norm(x.float(), self.weight, self.eps).to(x.dtype)


class Attention(nn.Module):
    """This rank's heads of one layer: fused qkv_proj, optional per-head q/k norms, rope, the layer's window
    and soft-cap, o_proj."""

    def __init__(self, spec: ModelSpec, comm: Communicator, layer: int) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads, self.num_kv_heads = spec.num_heads // comm.size, spec.num_kv_heads // comm.size
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.scale = spec.scale
        self.window = spec.layer_windows[layer]
        self.softcap = spec.attn_softcap
        self.qkv_proj = Linear(spec.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, [spec.hidden_size], bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, offset=spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, offset=spec.norm_offset)
        self.qk_norm = spec.qk_norm
        self.k_cache = self.v_cache = torch.empty(0)  # [pages, block_size, kv_heads, head_dim]: attach_pages
        self.k_scales = self.v_scales = None  # an fp8 cache's [num_blocks, block_size, kv_heads] float32
        self.cos_sin_cache = torch.empty(0)  # [positions, rotary_dim], shared by the layers of one rope

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, ctx)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # per head, before rope
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, self.cos_sin_cache if ctx.rope_table is None else ctx.rope_table)
        scales = (self.k_scales, self.v_scales)
        kernels.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, *scales)
        if ctx.is_decode:
            out = kernels.paged_attention_decode(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale, *scales,
                window=self.window, softcap=self.softcap, meta=ctx.decode_meta(self.k_cache),
            )
        else:
            out = kernels.paged_attention_prefill(
                q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.block_tables, ctx.context_lens, self.scale,
                *scales, window=self.window, softcap=self.softcap, key_limits=ctx.key_limits,
            )
        return self.comm.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size), ctx))


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), gate and up fused; act is SiLU or tanh-approximated GELU."""

    def __init__(self, spec: ModelSpec, comm: Communicator, *, intermediate_size: int | None = None,
                 reduce: bool = True) -> None:
        """intermediate_size: other than the spec's (an MoE's shared expert); reduce=False leaves the partial
        sum to the caller's all-reduce."""
        super().__init__()
        self.comm, self.reduce = comm, reduce
        inter = (intermediate_size or spec.intermediate_size) // comm.size  # this rank's slice
        self.gate_up_proj = Linear(spec.hidden_size, [inter, inter], bias=spec.mlp_bias)
        self.down_proj = Linear(inter, [spec.hidden_size], bias=spec.mlp_bias)
        self.act_and_mul = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}[spec.activation]

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x, ctx)), ctx)
        return self.comm.all_reduce(out) if self.reduce else out
