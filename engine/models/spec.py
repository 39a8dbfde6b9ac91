"""What a model family's Hugging Face config says, read once into a typed spec.

Everything the shared layers vary on by data lives here: the rope of each layer, the window of each
layer, norm offset, q/k norms, soft-caps, query and embedding scales, activation, biases. Both config
shapes in the wild are read: transformers 5's (`rope_parameters`, `layer_types`) and the older one
(`rope_theta` + `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`, `use_sliding_window`)."""

import math
from dataclasses import dataclass, field

from kernels.reference import ROPE_TYPES  # what kernels.rope_cos_sin_cache computes, as transformers does

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: dict | None = field(default=None, hash=False)  # {"rope_type": ..., its parameters}; None: default
    rotary_dim: int = 0  # the leading dims of a head that rotate (partial rotary); set by ModelSpec

    @property
    def rope_type(self) -> str:
        return (self.scaling or {}).get("rope_type", "default")

    @property
    def original_max_positions(self) -> int | None:
        """LongRoPE: past this many tokens a sequence's positions use the long factors."""
        return (self.scaling or {}).get("original_max_position_embeddings")

    def long_rows(self, prompt_len: int) -> bool:
        """Whether every token of a sequence with this prompt reads LongRoPE's long-factor rows (the prompt is
        longer than the original context); its KV then differs from a shorter prompt's over the same tokens."""
        original = self.original_max_positions
        return self.rope_type == "longrope" and original is not None and prompt_len > original


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense GatedMLP
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none), gated by sigmoid(shared_expert_gate)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec  # of every layer, or of the full-attention ones when local_rope is set
    local_rope: RopeSpec | None  # Gemma 3: the sliding layers' own rope base
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window (a key is seen by the next W queries)
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w), in float32
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3, Gemma 3)
    query_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_softcap: float | None = None  # output logits alike
    embed_scale: float | None = None  # embeddings times this, in the model dtype (Gemma: sqrt(hidden))
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    moe: MoESpec | None = None  # the experts of an MoE family (engine/models/moe.py)
    mrope_section: tuple[int, ...] | None = None  # multimodal rope: frequencies rotated by (t, h, w) positions
    vision: dict | None = field(default=None, hash=False, compare=False)  # a vision-language model's vision_config
    image_token_id: int | None = None  # its image placeholder token
    bidirectional_images: bool = False  # an image's tokens attend to each other both ways (Gemma 3)

    @property
    def sliding_window(self) -> int | None:
        """The widest window of any layer, None when every layer attends to its whole context."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    def layer_rope(self, layer: int) -> RopeSpec:
        return self.local_rope if self.local_rope is not None and self.layer_windows[layer] else self.rope

    @classmethod
    def from_hf_config(cls, config: dict, *, default_layer_types, **family) -> "ModelSpec":
        """The spec of `config`; `default_layer_types(config)` gives the layer types of a config that names
        none, and `family` the facts a family's configs leave out (norm_offset, qkv_bias, ...)."""
        architecture = config["architectures"][0]
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // heads
        num_layers = config["num_hidden_layers"]
        layer_types = config.get("layer_types") or default_layer_types(config)
        window = config.get("sliding_window")
        windows = tuple(window if kind == SLIDING else None for kind in layer_types[:num_layers])
        rope, local_rope = _ropes(config, head_dim)
        activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        query_pre_attn_scalar = config.get("query_pre_attn_scalar")
        read = dict(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope=rope,
            local_rope=local_rope,
            layer_windows=windows,
            query_scale=query_pre_attn_scalar**-0.5 if query_pre_attn_scalar else 0.0,
            attn_softcap=config.get("attn_logit_softcapping"),
            final_softcap=config.get("final_logit_softcapping"),
            activation=ACTIVATIONS[activation],
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=config.get("attention_bias") or False,
            o_bias=config.get("attention_bias") or False,
            mlp_bias=config.get("mlp_bias") or False,
        )
        return cls(**{**read, **family})


def every_layer_windowed(config: dict) -> list[str]:
    """Mistral: the window (if any) on every layer."""
    return [SLIDING if config.get("sliding_window") else FULL] * config["num_hidden_layers"]


def embedding_scale(config: dict) -> float:
    return math.sqrt(config["hidden_size"])


def _ropes(config: dict, head_dim: int) -> tuple[RopeSpec, RopeSpec | None]:
    """(the rope of the full-attention layers, the sliding layers' own or None); refuses a rope type the
    kernels do not compute."""
    params = config.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5, one rope per layer type (Gemma 3)
        full, local = params.get(FULL) or {}, params.get(SLIDING)
    else:
        legacy = config.get("rope_scaling") or {}
        full = {**params, **legacy, "rope_theta": params.get("rope_theta", config.get("rope_theta", 10000.0))}
        local_theta = config.get("rope_local_base_freq")
        local = {"rope_type": "default", "rope_theta": local_theta} if local_theta else None
    factor = config.get("partial_rotary_factor") or full.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * factor)
    rope = _rope(full, rotary_dim)
    return rope, (_rope(local, rotary_dim) if local is not None else None)


def _rope(params: dict, rotary_dim: int) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    return RopeSpec(theta=float(params.get("rope_theta", 10000.0)),
                    scaling=None if rope_type == "default" else scaling, rotary_dim=rotary_dim)
