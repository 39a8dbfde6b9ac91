"""The Llama family (Llama 2/3, Mistral, Qwen2) over a paged KV cache, mirroring transformers'
modeling_llama with q/k/v and gate/up fused."""

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.models.linear import Linear
from engine.parallel.communicator import Communicator

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        rope_scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = config["num_attention_heads"]
        qwen2 = architecture == "Qwen2ForCausalLM"
        window = config.get("sliding_window") if (not qwen2 or config.get("use_sliding_window")) else None
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=qwen2 or config.get("attention_bias", False),
            o_bias=not qwen2 and config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            sliding_window=window,
        )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """This rank's heads: column-parallel qkv_proj, row-parallel o_proj completed by one all-reduce."""

    def __init__(self, args: ModelArgs, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads, self.num_kv_heads = args.num_heads // comm.size, args.num_kv_heads // comm.size
        self.head_dim = args.head_dim
        self.q_size, self.kv_size = self.num_heads * args.head_dim, self.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.qkv_proj = Linear(args.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, [args.hidden_size], bias=args.o_bias)
        self.k_cache = self.v_cache = torch.empty(0)  # [pages, block_size, kv_heads, head_dim]: attach_pages
        self.k_scales = self.v_scales = None  # an fp8 cache's [num_blocks, block_size, kv_heads] float32
        self.cos_sin_cache = torch.empty(0)  # [max_positions, head_dim], shared by every layer

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, ctx)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(ctx.positions, q, k, self.cos_sin_cache)
        scales = (self.k_scales, self.v_scales)
        kernels.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, *scales)
        if ctx.is_decode:
            out = kernels.paged_attention_decode(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale, *scales
            )
        else:
            out = kernels.paged_attention_prefill(
                q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.block_tables, ctx.context_lens, self.scale,
                *scales
            )
        return self.comm.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size), ctx))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        inter = args.intermediate_size // comm.size  # this rank's slice
        self.gate_up_proj = Linear(args.hidden_size, [inter, inter], bias=args.mlp_bias)
        self.down_proj = Linear(inter, [args.hidden_size], bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.comm.all_reduce(self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x, ctx)), ctx))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, comm: Communicator) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, comm)
        self.mlp = LlamaMLP(args, comm)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: Context):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, ctx), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, comm: Communicator) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, comm) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our parameter, slice index in a fused projection)
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, args: ModelArgs, comm: Communicator | None = None) -> None:
        """The model, or with `comm` of size N its shard for rank comm.rank (engine.parallel.sharding)."""
        super().__init__()
        self.args = args
        self.comm = comm or Communicator()
        self.model = LlamaModel(args, self.comm)
        self.lm_head = Linear(args.hidden_size, [args.vocab_size], bias=False)
        self.tie_weights()
        self.build_rope_cache()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_rope_cache(self) -> None:
        """The rotary table, on the default device (the loader builds it again for a model made on meta)."""
        args = self.args
        self.cos_sin_cache = kernels.rope_cos_sin_cache(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling
        )  # [max_positions, head_dim] float32
        for layer in self.model.layers:
            layer.self_attn.cos_sin_cache = self.cos_sin_cache

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the step."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

    def checkpoint_target(self, name: str) -> tuple[str, str, int | None] | None:
        """Where a checkpoint tensor goes: (module, "weight" or "bias", slice of a fused projection or None),
        or None for one the model does not use."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.args.tie_word_embeddings):
            return None
        module_name, _, kind = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if proj in self.fused:
            target, index = self.fused[proj]
            return f"{parent}.{target}", kind, index
        return module_name, kind, None

    def load_weights(self, weights) -> None:
        """weights: iterable of (checkpoint name, tensor); every parameter must be covered. Modules are looked up
        as each tensor comes, so a loader may replace one between tensors (engine/models/loader.py)."""
        params = {name for name, _ in self.named_parameters()}  # names only: a loader may free the tensors
        fused_names = {target for target, _ in self.fused.values()}
        fused = {name for name, _ in self.named_modules() if name.rpartition(".")[2] in fused_names}
        loaded = set()
        for name, tensor in weights:
            target = self.checkpoint_target(name)
            if target is None:
                continue
            module_name, kind, index = target
            if index is not None and module_name in fused:
                self.get_submodule(module_name).load_slice(index, kind, tensor)
                loaded.add(f"{module_name}.{kind}#{index}")
            elif index is None and name in params:
                getattr(self.get_submodule(module_name), kind).data.copy_(tensor)
                loaded.add(name)
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
        expected = set()
        for name in params:
            module_name, _, kind = name.rpartition(".")
            if module_name in fused:
                expected |= {f"{name}#{i}" for i in range(len(self.get_submodule(module_name).out_slices))}
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
