"""Which projections of a base model a LoRA may adapt, per family, and their shapes, read from its config.json.

Every served family names its projections as Llama does (q/k/v/o, gate/up/down), except Phi-3, whose
checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`. PEFT on the real Phi-3 writes
adapters on the fused names; adapters trained on a split ("llamafied") Phi-3 carry the split names. Both
are served: a split name stands for its rows of the fused projection.

The MoE families' experts are stacked parameters (transformers 5): `mlp.experts.gate_up_proj` [E, 2I, hidden]
and `mlp.experts.down_proj` [E, hidden, I]. PEFT adapts them through `target_parameters` with every expert's
own A and B stacked along the rank (lora_A [E*r, in], lora_B [out, E*r]); Quilt names them
`experts_gate_up_proj` and `experts_down_proj` (EXPERT_MODULES), r being the rank of each expert.
"""

from dataclasses import dataclass
from typing import Any

from adapters.errors import AdapterError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_MODULES + MLP_MODULES  # the split projections: the engine's per-module columns
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Qwen2-MoE's shared expert, a gated MLP beside the experts: mlp.shared_expert.{gate,up,down}_proj
SHARED_EXPERT_MODULES = ("shared_expert_gate_proj", "shared_expert_up_proj", "shared_expert_down_proj")
ROUTER = "router"  # an MoE layer's router, mlp.gate: PEFT adapts its weight through target_parameters (`gate.weight`)
EXPERT_PARAMETERS = {"experts_gate_up_proj": "gate_up_proj", "experts_down_proj": "down_proj"}  # -> PEFT's
EXPERT_MODULES = tuple(EXPERT_PARAMETERS)
ALL_MODULES = PROJECTIONS + tuple(FUSED_PROJECTIONS) + SHARED_EXPERT_MODULES + (ROUTER,) + EXPERT_MODULES  # every name a
# canonical adapter may carry
_FUSED_OF = {split: fused for fused, splits in FUSED_PROJECTIONS.items() for split in splits}


@dataclass(frozen=True)
class Family:
    """What an adapter may target in one model family."""

    name: str  # for people: "Phi-3"
    architecture: str  # config.json's architectures[0]
    projections: tuple[str, ...]  # the base's own LoRA-servable linear layers
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # per decoder layer
    head_norms: bool = False  # self_attn.q_norm / k_norm (Qwen3, Gemma 3)
    activation: str = "act_fn"  # the MLP's activation module
    experts: bool = False  # a mixture of experts: LoRA on the stacked experts (EXPERT_MODULES) too
    shared_expert: bool = False  # and a shared expert on its sparse layers (SHARED_EXPERT_MODULES)
    language_model: str = "model"  # the decoder's path in the model PEFT wraps (a vision-language model's own)
    vision_tower: str | None = None  # a vision-language model's vision encoder, whose modules LoRA is refused on
    vision_blocks: str = "blocks"  # its blocks' list, under vision_tower
    vision_block_linears: tuple[str, ...] = ()  # the linear layers of each of its blocks
    vision_linears: tuple[str, ...] = ()  # and its others (patch embedding, mergers)
    text_defaults: tuple[tuple[str, Any], ...] = ()  # what its text_config may leave out, as transformers fills it

    @property
    def split_aliases(self) -> tuple[str, ...]:
        """Split names served in place of this family's fused projections (Phi-3's q_proj, ..., up_proj)."""
        return tuple(split for fused in self.projections for split in FUSED_PROJECTIONS.get(fused, ()))

    @property
    def servable(self) -> tuple[str, ...]:
        return tuple(m for m in ALL_MODULES if m in self.projections or m in self.split_aliases
                     or (self.experts and m in (*EXPERT_MODULES, ROUTER))
                     or (self.shared_expert and m in SHARED_EXPERT_MODULES))

    def describe(self) -> str:
        return f"a {self.name} base ({self.architecture})"

    def served_list(self) -> str:
        text = ", ".join(self.projections)
        if self.shared_expert:
            text += ", the shared expert's gate_proj, up_proj, down_proj"
        if self.experts:
            text += " and, through target_parameters, the experts' stacked gate_up_proj and down_proj and the router"
        return f"{text} (or the split {', '.join(self.split_aliases)})" if self.split_aliases else text

    def missing_module(self, module: str, *, where: str) -> AdapterError:
        """The refusal of an adapter that adapts a module this family's base does not have."""
        return AdapterError(
            "unsupported_module",
            f"{where} {module}, which {self.describe()} does not have; LoRA is served on {self.served_list()}",
        )


_SPLIT = PROJECTIONS
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")  # fmt: skip
FAMILIES: dict[str, Family] = {  # by config.json's model_type
    "llama": Family("Llama", "LlamaForCausalLM", _SPLIT),
    "mistral": Family("Mistral", "MistralForCausalLM", _SPLIT),
    "qwen2": Family("Qwen2", "Qwen2ForCausalLM", _SPLIT),
    "qwen3": Family("Qwen3", "Qwen3ForCausalLM", _SPLIT, head_norms=True),
    "gemma2": Family("Gemma 2", "Gemma2ForCausalLM", _SPLIT, norms=_GEMMA_NORMS),
    "gemma3_text": Family("Gemma 3", "Gemma3ForCausalLM", _SPLIT, norms=_GEMMA_NORMS, head_norms=True),
    "phi3": Family("Phi-3", "Phi3ForCausalLM", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                   activation="activation_fn"),
    # MoE bases: LoRA on attention, the experts and Qwen2-MoE's shared expert (not the dense MLP of mlp_only_layers)
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeForCausalLM", ATTENTION_MODULES, head_norms=True, experts=True),
    "qwen2_moe": Family("Qwen2-MoE", "Qwen2MoeForCausalLM", ATTENTION_MODULES, experts=True, shared_expert=True),
    "mixtral": Family("Mixtral", "MixtralForCausalLM", ATTENTION_MODULES, experts=True),
    "qwen2_5_vl": Family("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", _SPLIT,
                         language_model="model.language_model", vision_tower="model.visual",
                         vision_block_linears=("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj",
                                               "mlp.down_proj"),
                         vision_linears=("patch_embed.proj", "merger.mlp.0", "merger.mlp.2")),
    "qwen3_vl": Family("Qwen3-VL", "Qwen3VLForConditionalGeneration", _SPLIT, head_norms=True,
                       language_model="model.language_model", vision_tower="model.visual",
                       vision_block_linears=("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"),
                       vision_linears=("patch_embed.proj", "merger.linear_fc1", "merger.linear_fc2")),
    "gemma3": Family("Gemma 3", "Gemma3ForConditionalGeneration", _SPLIT, norms=_GEMMA_NORMS, head_norms=True,
                     language_model="model.language_model", vision_tower="model.vision_tower",
                     vision_blocks="encoder.layers",
                     vision_block_linears=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.out_proj", "mlp.fc1", "mlp.fc2"),
                     vision_linears=("embeddings.patch_embedding",),
                     text_defaults=(("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256))),
}  # fmt: skip
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def fused_of(module: str) -> str | None:
    """The fused projection a split name is part of (q_proj -> qkv_proj), None for o_proj / down_proj."""
    return _FUSED_OF.get(module)


def module_parent(module: str) -> str:
    if module in SHARED_EXPERT_MODULES:
        return "mlp.shared_expert"
    return "self_attn" if module in ATTENTION_MODULES or module == "qkv_proj" else "mlp"


def peft_module_key(layer: int, module: str, decoder: str = "model") -> str:
    """The module's name inside the `*ForCausalLM` model (its decoder at `decoder`), which is what PEFT matches
    its patterns against (for the experts: the stacked parameter's name, which PEFT matches target_parameters and
    patterns against)."""
    if module in EXPERT_PARAMETERS:
        return f"{decoder}.layers.{layer}.mlp.experts.{EXPERT_PARAMETERS[module]}"
    if module == ROUTER:
        return f"{decoder}.layers.{layer}.mlp.gate.weight"
    return f"{decoder}.layers.{layer}.{module_parent(module)}.{module.removeprefix('shared_expert_')}"


@dataclass(frozen=True)
class BaseShapes:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0  # MoE bases: experts per sparse layer, their intermediate size, and those layers
    expert_intermediate_size: int = 0
    expert_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    vision_depth: int = 0  # a vision-language model's vision encoder blocks
    vision_deepstack: int = 0  # and its deepstack mergers (Qwen3-VL)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BaseShapes":
        if not isinstance(config, dict):
            raise AdapterError("unsupported_base_model", "the base model's config.json is not a JSON object")
        model_type = config.get("model_type")
        vision = config.get("vision_config") or {}
        vision_depth = vision.get("depth", vision.get("num_hidden_layers", 0))
        vision_deepstack = len(vision.get("deepstack_visual_indexes", ()))
        if model_type not in FAMILIES:
            served = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
            raise AdapterError(
                "unsupported_base_model", f"base model type {model_type!r} is not served; supported: {served}"
            )
        if isinstance(config.get("text_config"), dict):  # a vision-language model: LoRA on its language model
            text = {**dict(FAMILIES[model_type].text_defaults), **config["text_config"]}
            config = {**config, **text, "model_type": model_type}
        hidden = _positive_int(config, "hidden_size")
        heads = _positive_int(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        num_layers = _positive_int(config, "num_hidden_layers")
        experts = _experts(config, model_type, num_layers) if FAMILIES[model_type].experts else {}
        shapes = cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=_positive_int(config, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vision_depth=vision_depth,
            vision_deepstack=vision_deepstack,
            **experts,
        )
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or heads % kv_heads:
            raise AdapterError(
                "unsupported_base_model",
                f"base config has {heads} attention heads, {kv_heads!r} key/value heads and head_dim {head_dim!r}",
            )
        return shapes

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of the projection's nn.Linear (fused ones: all their slices; the experts:
        one expert's)."""
        if module == "experts_gate_up_proj":
            return self.hidden_size, 2 * self.expert_intermediate_size
        if module == "experts_down_proj":
            return self.expert_intermediate_size, self.hidden_size
        if module == ROUTER:
            return self.hidden_size, self.num_experts
        if module in SHARED_EXPERT_MODULES:
            inter = self.shared_expert_intermediate_size
            return (inter, self.hidden_size) if module == "shared_expert_down_proj" else (self.hidden_size, inter)
        if module in FUSED_PROJECTIONS:
            widths = [self.in_out(split) for split in FUSED_PROJECTIONS[module]]
            return widths[0][0], sum(out for _, out in widths)
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_width),
            "k_proj": (self.hidden_size, kv_width),
            "v_proj": (self.hidden_size, kv_width),
            "o_proj": (q_width, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]

    def lora_shapes(self, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Expected (lora_A, lora_B) shapes in PEFT orientation: A [r, in], B [out, r]; the experts stacked
        along the rank: A [E*r, in], B [out, E*r]."""
        in_features, out_features = self.in_out(module)
        rows = rank * self.num_experts if module in EXPERT_MODULES else rank
        return (rows, in_features), (out_features, rows)

    def check_modules(self, modules: set[str] | list[str], *, where: str = "the adapter adapts") -> None:
        """AdapterError naming the first module (of "layers.{i}.{module}" or bare names) this family lacks."""
        for module in modules:
            name = module.rsplit(".", 1)[-1]
            if name not in self.family.servable:
                raise self.family.missing_module(name, where=where)

    def named_modules(self) -> dict[str, str]:
        """Every module name of the `*ForCausalLM` model PEFT could be pointed at, mapped to what it is."""
        family = self.family
        decoder = family.language_model
        names = {"": "model", "model": "model", decoder: "model", f"{decoder}.layers": "layer list",
                 f"{decoder}.rotary_emb": "rotary"}
        names |= {f"{decoder}.embed_tokens": "embedding", "lm_head": "lm_head", f"{decoder}.norm": "norm"}
        if family.vision_tower is not None:
            names |= {name: "vision tower" for name in self._vision_modules()}
        for layer in range(self.num_layers):
            prefix = f"{decoder}.layers.{layer}"
            names |= {prefix: "decoder layer", f"{prefix}.self_attn": "attention", f"{prefix}.mlp": "MLP"}
            for module in family.projections:
                names[peft_module_key(layer, module, decoder)] = module
            for norm in family.norms:
                names[f"{prefix}.{norm}"] = "norm"
            if family.head_norms:
                names |= {f"{prefix}.self_attn.q_norm": "norm", f"{prefix}.self_attn.k_norm": "norm"}
            names[f"{prefix}.mlp.{family.activation}"] = "activation"
            if layer in self.expert_layers:
                names |= {f"{prefix}.mlp.experts": "experts", f"{prefix}.mlp.gate": "router"}
                if family.shared_expert:
                    names |= {f"{prefix}.mlp.shared_expert": "shared expert",
                              f"{prefix}.mlp.shared_expert_gate": "shared expert gate",
                              f"{prefix}.mlp.shared_expert.{family.activation}": "activation"}
                    names |= {peft_module_key(layer, m): m for m in SHARED_EXPERT_MODULES}
        return names

    def _vision_modules(self) -> list[str]:
        """The linear layers of a vision-language model's vision encoder and projector."""
        family = self.family
        tower = family.vision_tower
        blocks = [f"{tower}.{family.vision_blocks}.{i}.{m}" for i in range(self.vision_depth)
                  for m in family.vision_block_linears]
        deepstack = [f"{tower}.deepstack_merger_list.{i}.{m}" for i in range(self.vision_deepstack)
                     for m in ("linear_fc1", "linear_fc2")]
        return [*blocks, *deepstack, *(f"{tower}.{m}" for m in family.vision_linears)]

    def expert_parameters(self) -> dict[str, str]:
        """PEFT's key of every parameter target_parameters may name (the stacked experts' and the router's weight),
        mapped to its module."""
        return {peft_module_key(layer, module): module for layer in self.expert_layers
                for module in (*EXPERT_MODULES, ROUTER)}

    def split_alias_modules(self) -> dict[str, str]:
        """The split names a Phi-3 adapter may use in place of the fused projections, by PEFT key; empty for
        families that have no fused projection."""
        return {
            peft_module_key(layer, split): split
            for layer in range(self.num_layers)
            for split in self.family.split_aliases
        }


def _experts(config: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """num_experts, expert_intermediate_size and expert_layers of a MoE config (engine/models/moe.py reads them
    alike): Mixtral's experts are on every layer and as wide as intermediate_size; Qwen's on every
    decoder_sparse_step-th layer not in mlp_only_layers, moe_intermediate_size wide."""
    count = config.get("num_experts") or config.get("num_local_experts") or 0
    if model_type == "mixtral":
        return {"num_experts": count, "expert_intermediate_size": _positive_int(config, "intermediate_size"),
                "expert_layers": tuple(range(num_layers)) if count else ()}
    shared = config.get("shared_expert_intermediate_size", 0) if FAMILIES[model_type].shared_expert else 0
    step, dense = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if count and i not in dense and (i + 1) % step == 0)
    return {"num_experts": count, "expert_intermediate_size": _positive_int(config, "moe_intermediate_size"),
            "expert_layers": layers, "shared_expert_intermediate_size": shared or 0}


def _positive_int(config: dict[str, Any], field: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(
            "unsupported_base_model", f"base config field {field!r} is {value!r}, expected a positive integer"
        )
    return value
