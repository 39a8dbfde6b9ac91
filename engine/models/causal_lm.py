"""What every family's *ForCausalLM shares: embeddings, the stack of its decoder layers, the final norm,
lm_head, rope tables, logits, and loading a checkpoint's tensors into fused projections.

A family gives its decoder layer class and how its configs read (`read_spec`); a layer takes
(positions, hidden, residual, ctx) and returns (hidden, residual), residual None for a family whose
layers add their own (Gemma)."""

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.models.layers import RMSNorm
from engine.models.linear import Linear
from engine.models.spec import ModelSpec, RopeSpec
from engine.parallel.communicator import Communicator


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, comm: Communicator, layer_cls) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_scale = spec.embed_scale
        self.layers = nn.ModuleList(layer_cls(spec, comm, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, offset=spec.norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
                embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """embeds: the tokens' embeddings, scaled, when the caller made them (image tokens' from the vision
        encoder); deepstack: (rows [N], a [N, hidden] tensor per layer) added to those rows' hidden states after
        each of the first layers (Qwen3-VL)."""
        x, residual = self.embed(input_ids) if embeds is None else embeds, None  # [T, hidden]
        rows, added = deepstack or (None, [])
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, ctx)
            if i < len(added):
                x = x.index_add(0, rows, added[i].to(x.dtype))
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] token embeddings, times the family's embed_scale in the model dtype as transformers does."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)


class CausalLM(nn.Module):
    decoder_layer: type[nn.Module]  # the family's layer: (spec, comm, layer index)
    # checkpoint projection -> (our fused projection, its slice)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        raise NotImplementedError

    def __init__(self, spec: ModelSpec, comm: Communicator | None = None) -> None:
        """The model, or with `comm` of size N its shard for rank comm.rank (engine.parallel.sharding)."""
        super().__init__()
        self.spec = spec
        self.comm = comm or Communicator()
        self.model = DecoderModel(spec, self.comm, self.decoder_layer)
        self.lm_head = Linear(spec.hidden_size, [spec.vocab_size], bias=False)
        self.tie_weights()
        self.build_rope_cache()

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_rope_cache(self) -> None:
        """The rotary tables, on the default device (the loader builds them again for a model made on meta):
        one per distinct rope, each shared by the layers that use it."""
        spec = self.spec
        self.cos_sin_cache = _cos_sin_cache(spec.rope, spec)  # [positions, rotary_dim] float32
        local = _cos_sin_cache(spec.local_rope, spec) if spec.local_rope is not None else None
        for i, layer in enumerate(self.model.layers):
            is_local = local is not None and spec.layer_rope(i) is spec.local_rope
            layer.self_attn.cos_sin_cache = local if is_local else self.cos_sin_cache

    def rope_positions(self, ctx: Context) -> torch.Tensor:
        """Each token's row of the rope tables. LongRoPE tables hold the short-factor rows, then the long-factor
        ones. transformers picks the long factors for a whole forward call whose last position is past the
        original context: its generate() prefills a prompt in one call, then runs one call per token. So a
        token at position p reads the long rows when max(its prompt's length, p + 1) exceeds the original
        context, whatever chunks the engine prefills in (RopeSpec.long_rows)."""
        original = self.spec.rope.original_max_positions
        if self.spec.rope.rope_type != "longrope" or original is None:
            return ctx.positions
        counts = (ctx.cu_seqlens_q[1:] - ctx.cu_seqlens_q[:-1]).long()  # [B]
        prompt_lens = ctx.prompt_lens.long().repeat_interleave(counts, output_size=ctx.positions.shape[0])  # [T], no sync
        is_long = (torch.maximum(prompt_lens, ctx.positions + 1) > original).long()  # [T]
        return ctx.positions + is_long * self.spec.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the step."""
        return self.model(input_ids, self.rope_positions(ctx), ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, vocab]
        cap = self.spec.final_softcap
        if cap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def checkpoint_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]] | None:
        """A checkpoint tensor that fuses several projections (Phi-3's qkv_proj) as the split ones it holds:
        (split name, first row, end row); None for any other tensor."""
        return None

    def checkpoint_target(self, name: str) -> tuple[str, str, int | None] | None:
        """Where a checkpoint tensor goes: (module, "weight" or "bias", slice of a fused projection or None),
        or None for one the model does not use."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
            return None
        module_name, _, kind = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if proj in self.packed:
            target, index = self.packed[proj]
            return f"{parent}.{target}", kind, index
        return module_name, kind, None

    def load_weights(self, weights) -> None:
        """weights: iterable of (checkpoint name, tensor); every parameter must be covered. Modules are looked up
        as each tensor comes, so a loader may replace one between tensors (engine/models/loader.py)."""
        params = {name for name, _ in self.named_parameters()}  # names only: a loader may free the tensors
        fused_names = {target for target, _ in self.packed.values()}
        fused = {name for name, module in self.named_modules()
                 if name.rpartition(".")[2] in fused_names or hasattr(module, "slice_count")}
        packed = {name for name, module in self.named_modules() if getattr(module, "loads_as_stored", False)}
        loaded = set()
        for name, tensor in weights:
            target = self.checkpoint_target(name)
            if target is None:
                continue
            module_name, kind, index = target
            module = self.get_submodule(module_name) if module_name in packed else None
            if index is None and len(getattr(module, "out_slices", ())) > 1:  # stored fused (Phi-3's qkv_proj)
                module.load_fused(kind, tensor)
                loaded |= {f"{module_name}.{kind}#{i}" for i in range(len(module.out_slices))}
            elif module_name in packed or (index is not None and module_name in fused):
                index = index or 0  # a pre-quantized projection (o, down) is its slice 0
                self.get_submodule(module_name).load_slice(index, kind, tensor)
                loaded.add(f"{module_name}.{kind}#{index}")
            elif index is None and f"{module_name}.{kind}" in params:
                module = self.get_submodule(module_name)
                if isinstance(module, RMSNorm):
                    module.load_weight(tensor)
                else:
                    getattr(module, kind).data.copy_(tensor)
                loaded.add(f"{module_name}.{kind}")
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
        expected = set()
        for name in params:
            module_name, _, kind = name.rpartition(".")
            if module_name in fused:
                module = self.get_submodule(module_name)  # slice_count: an MoE's stacked experts
                count = module.slice_count(kind) if hasattr(module, "slice_count") else len(module.out_slices)
                expected |= {f"{name}#{i}" for i in range(count)}
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")


def _cos_sin_cache(rope: RopeSpec, spec: ModelSpec) -> torch.Tensor:
    return kernels.rope_cos_sin_cache(spec.head_dim, spec.max_position_embeddings, rope.theta, rope.scaling,
                                      rotary_dim=rope.rotary_dim, max_position_embeddings=spec.max_position_embeddings)
