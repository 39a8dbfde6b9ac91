"""Mixture-of-experts layers shared by the MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral): top-k routing, the
experts as one grouped computation over expert-sorted rows, an optional shared expert, and the decoder layer.

Routing follows transformers: softmax over every expert in float32, the top k, renormalised to sum to one when
the family says so, cast to the model dtype. The experts' weights are stacked: gate_up_proj [E, 2I, hidden]
(gate rows then up rows, as GatedMLP) and down_proj [E, hidden, I]; a token's k (token, expert) rows are sorted
by expert and `kernels.grouped_matmul` runs every expert over its rows in one launch, twice, with the activation
between. Under tensor parallelism each rank holds every expert's slice of the intermediate (its rows of gate
and up, its columns of down), and the layer's partial sums ride one all-reduce, as GatedMLP's do."""

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.models.causal_lm import CausalLM
from engine.models.layers import Attention, GatedMLP, RMSNorm
from engine.models.linear import Linear
from engine.models.llama import LlamaDecoderLayer
from engine.models.spec import ModelSpec
from engine.parallel.communicator import Communicator

_EXPERT_PIECES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_EXPERT_KINDS = {"weight": "", "weight_scale_inv": "_scale"}  # an fp8 checkpoint's block scales (Fp8Experts)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """(weights [T, k] in dtype, expert ids [T, k]) of router logits [T, E]: softmax in float32, top k,
    renormalised or not."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """(order [T * k]: the (token, choice) pairs sorted by expert, stably; offsets [E + 1] int32: expert e's
    rows are offsets[e] <= r < offsets[e + 1] of the sorted pairs). Device ops only (bincount would read the
    largest id back on CUDA)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


class Experts(nn.Module):
    """This rank's slice of every expert, stacked; loaded per checkpoint tensor (experts.{e}.{gate,up,down}_proj)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, activation: str) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.act_and_mul = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}[activation]

    def slice_count(self, kind: str) -> int:
        """How many checkpoint tensors fill parameter `kind` (CausalLM.load_weights checks them all)."""
        return 2 * self.num_experts if kind == "gate_up_proj" else self.num_experts

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """gate_up_proj piece 2e (gate) or 2e + 1 (up), down_proj piece e."""
        if kind not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"unexpected {kind} for experts held in full precision")
        if kind == "gate_up_proj":
            expert, part = divmod(index, 2)
            self.gate_up_proj.data[expert, part * self.inter : (part + 1) * self.inter].copy_(tensor)
        else:
            self.down_proj.data[index].copy_(tensor)

    def project(self, projection: str, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each expert's `projection` ("gate_up_proj", "down_proj") over its rows of the expert-sorted batch."""
        return kernels.grouped_matmul(rows, getattr(self, projection), offsets)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx: Context | None = None,
                lora=None) -> torch.Tensor:
        """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]); x [T, hidden] -> [T, hidden]. `lora`
        (LoRAExperts) adds each row's adapter delta to the rows of each projection."""
        top_k = ids.shape[1]
        order, offsets = sort_by_expert(ids, self.num_experts)
        tokens = order // top_k  # [T * k] the token of each sorted row
        rows = x[tokens]  # [T * k, hidden]
        experts = ids.flatten()[order] if lora is not None else None  # [T * k] the expert of each sorted row
        h = self.project("gate_up_proj", rows, offsets)  # [T * k, 2I]
        if lora is not None:
            lora(h, rows, "gate_up_proj", tokens, experts, ctx)
        act = self.act_and_mul(h)  # [T * k, I]
        y = self.project("down_proj", act, offsets)  # [T * k, hidden]
        if lora is not None:
            lora(y, act, "down_proj", tokens, experts, ctx)
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y)


class SparseMoE(nn.Module):
    """Router (`gate`), experts, and (Qwen2-MoE) a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, spec: ModelSpec, comm: Communicator) -> None:
        super().__init__()
        moe = spec.moe
        self.comm, self.top_k, self.renormalize = comm, moe.top_k, moe.renormalize
        self.gate = Linear(spec.hidden_size, [moe.num_experts], bias=False)
        self.experts = Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size // comm.size, spec.activation)
        self.shared_expert = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(spec, comm, intermediate_size=moe.shared_intermediate_size, reduce=False)
            self.shared_expert_gate = Linear(spec.hidden_size, [1], bias=False)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        weights, ids = route(self.gate(x, ctx), self.top_k, self.renormalize, x.dtype)
        out = self.experts(x, weights, ids, ctx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ctx)
        return self.comm.all_reduce(out)


class MoEDecoderLayer(LlamaDecoderLayer):
    """The Llama layer (pre-norms, residual fused into each norm) with experts on the sparse layers."""

    def __init__(self, spec: ModelSpec, comm: Communicator, layer: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Attention(spec, comm, layer)
        self.mlp = SparseMoE(spec, comm) if spec.moe.sparse_layers[layer] else GatedMLP(spec, comm)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class MoECausalLM(CausalLM):
    """A CausalLM whose checkpoint stores each expert's projections apart, mlp.experts.{e}.{gate,up,down}_proj (as
    transformers 5 saves them), or already stacked: mlp.experts.gate_up_proj [E, 2I, hidden] (gate rows, then up)
    and mlp.experts.down_proj [E, hidden, I], read as the experts' own tensors (`checkpoint_parts`)."""

    decoder_layer = MoEDecoderLayer

    def checkpoint_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple] | None:
        prefix, _, stacked = name.rpartition(".experts.")
        if len(shape) != 3 or stacked not in ("gate_up_proj", "down_proj"):
            return None
        experts, rows, _ = shape
        if stacked == "down_proj":
            return [(f"{prefix}.experts.{e}.down_proj.weight", e, 0, rows) for e in range(experts)]
        half = rows // 2
        return [(f"{prefix}.experts.{e}.{proj}.weight", e, start, start + half)
                for e in range(experts) for proj, start in (("gate_proj", 0), ("up_proj", half))]

    def checkpoint_target(self, name: str) -> tuple[str, str, int | None] | None:
        """An expert's tensor: into the stacked experts; a pre-quantized expert's (any stored kind, e.g. qweight):
        into that expert's own projection, experts.{gate_up_proj,down_proj}.{e} (engine/quantization/experts.py)."""
        parts = name.split(".")
        if len(parts) < 4 or parts[-4] != "experts" or parts[-2] not in _EXPERT_PIECES:
            return super().checkpoint_target(name)
        experts = self.get_submodule(".".join(parts[:-3]))
        kinds = getattr(experts, "stacked_kinds", _EXPERT_KINDS)  # compressed-tensors fp8 experts stack their scales
        kind, part = _EXPERT_PIECES[parts[-2]]
        if parts[-1] not in kinds or getattr(experts, "packed_experts", False):
            return f"{'.'.join(parts[:-3])}.{kind}.{parts[-3]}", parts[-1], part
        kind += kinds[parts[-1]]
        expert = int(parts[-3])
        index = 2 * expert + part if kind.startswith("gate_up_proj") else expert
        return ".".join(parts[:-3]), kind, index


def sparse_layers(config: dict) -> tuple[bool, ...]:
    """The Qwen-MoE rule: experts on every decoder_sparse_step-th layer not in mlp_only_layers."""
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    experts = num_experts(config)
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(config["num_hidden_layers"]))


def num_experts(config: dict) -> int:
    """`num_experts` (Qwen's configs) or `num_local_experts` (Mixtral's, and transformers 5 writes Qwen's so)."""
    return config.get("num_experts") or config.get("num_local_experts") or 0
