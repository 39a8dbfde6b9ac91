"""Tiny FP8 checkpoints written by the formats' own producers.

- `fp8` with weight_block_size [128, 128]: each decoder projection quantized by transformers' own
  finegrained-fp8 quantizer (`Fp8Quantize`, what `FineGrainedFP8Config` runs on a GPU to write Qwen3-FP8's
  layout: `weight` F8_E4M3, `weight_scale_inv` F32 per 128 x 128 block), the rest copied; the
  quantization_config is Qwen3-FP8's.
- GPTQModel's FP8Config with block scales: the same tensor names, but its `weight_scale_inv` is the inverse of a
  scale (`weight_scale_semantics: "inverse"`: the weight is weight / weight_scale_inv), and its own
  quantization_config fields (write_gptqmodel_block_fp8, with its dequantized twin as the oracle).
- compressed-tensors `float-quantized`: compressed-tensors' own `apply_quantization_config` and
  `ModelCompressor` (what llm-compressor's `oneshot` calls) with its FP8 presets; weight scales from the
  weights' min/max (llm-compressor's default observer) and static input scales from the inputs' absolute
  maximum over a few calibration prompts. An MoE's stacked experts are first made one Linear per expert and
  projection (LinearExperts), as llm-compressor does to calibrate them, so the checkpoint stores each expert's
  projections apart as the published FP8 MoE checkpoints do.

transformers loads such experts dequantized and runs them in full precision (their input_scale is left unread);
`quantize_expert_inputs` makes its experts quantize their inputs as the checkpoint says, the oracle the engine's
experts are held to.

Shapes are multiples of 128 (hidden 128, q 256, k/v 128, intermediate 256): transformers' quantizer leaves a
projection that is not whole blocks unquantized, and its CPU dequantization (the oracle's) reads a scale grid
that is not whole blocks as a different block size."""

import json
import re
import shutil
import types
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tests.engine.conftest import ARCHS, VOCAB, Oracle, build_tokenizer

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}
MOE_SHAPE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
             "mlp_only_layers": [1]}
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
               "qkv_proj", "gate_up_proj")  # the last two: Phi-3's fused ones


def build_base(directory: Path, arch: str, *, seed: int, **shape) -> Path:
    """A random full-precision (fp32) checkpoint of `arch` at the FP8 tests' shape, with the tests' tokenizer."""
    config_cls, model_cls, extra = ARCHS[arch]
    fields = {**extra, **SHAPE, **(MOE_SHAPE if arch in ("qwen3-moe", "mixtral") else {}), **shape}
    if arch == "mixtral":
        fields["intermediate_size"] = fields.pop("moe_intermediate_size")
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1,
                        eos_token_id=2, **fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from their initial ones, so a misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return ".layers." in name and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def _copy_other_files(src: Path, dst: Path, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def write_block_fp8(src: Path, dst: Path, *, drop: str | None = None, config: dict | None = None) -> Path:
    """`src` (fp32) as an `fp8` weight_block_size [128, 128] checkpoint, quantized by transformers' Fp8Quantize.
    drop: a tensor name left out (to test the refusal of a checkpoint missing its scales)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128])))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if _is_projection(name):
                out = quantizer._quantize_one(name, tensor)
                assert len(out) == 2, f"{name} {tuple(tensor.shape)} is not whole 128 x 128 blocks"
                tensors.update(out)
            else:
                tensors[name] = tensor
    if drop is not None:
        del tensors[drop]
    _copy_other_files(src, dst, config or BLOCK_CONFIG)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


GPTQMODEL_BLOCK_CONFIG = {  # what GPTQModel's FP8Config(weight_scale_method="block").to_dict() writes
    "bits": 8, "group_size": -1, "desc_act": False, "lm_head": False, "method": "fp8", "quant_method": "fp8",
    "format": "float8_e4m3fn", "checkpoint_format": "float8_e4m3fn", "pack_dtype": "int32",
    "meta": {"quantizer": ["gptqmodel:7.6.0"], "uri": "https://github.com/modelcloud/gptqmodel", "fallback": None,
             "offload_to_disk": True, "pack_impl": "cpu"},
    "weight_scale_method": "block", "weight_block_size": [128, 128], "weight_scale_semantics": "inverse"}


def quantize_block_inverse(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQModel's block fp8 quantization of weight [out, in] (whole 128 x 128 blocks): per block
    scale_inv = 448 / amax (1 for an all-zero block), q = clamp(w * scale_inv) in float8_e4m3fn. Returns (q,
    scale_inv [out / 128, in / 128] float32, the weight q stands for: q / scale_inv, in float32)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // 128, 128, cols // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3))  # [out / 128, in / 128]
    scale_inv = torch.where(amax > 0, 448.0 / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (blocks * scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    dequantized = q.float() / scale_inv[:, None, :, None]
    return q.reshape(rows, cols), scale_inv, dequantized.reshape(rows, cols)


def write_gptqmodel_block_fp8(src: Path, dst: Path, *, config: dict | None = None) -> Path:
    """`src` (fp32) as GPTQModel writes an FP8Config block checkpoint: `weight` F8_E4M3 and `weight_scale_inv` F32
    per 128 x 128 block whose meaning is `weight_scale_semantics: "inverse"` (the weight is weight /
    weight_scale_inv). Also writes `dst`-dequantized: the same model in fp32 with each projection dequantized so
    (transformers + PEFT load it as the oracle); returns that twin's path."""
    tensors, twin = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = twin[name] = f.get_tensor(name)
            if _is_projection(name):
                q, scale_inv, twin[name] = quantize_block_inverse(tensor)
                tensors[name], tensors[f"{name}_scale_inv"] = q, scale_inv
            else:
                tensors[name] = tensor
    reference = dst.with_name(dst.name + "-dequantized")
    for out, state in ((dst, tensors), (reference, twin)):
        _copy_other_files(src, out, config or GPTQMODEL_BLOCK_CONFIG)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    config_path = reference / "config.json"
    plain = json.loads(config_path.read_text())
    del plain["quantization_config"]
    config_path.write_text(json.dumps(plain, indent=2))
    return reference


def block_oracle(directory, adapters) -> Oracle:
    """transformers + PEFT on a weight_block_size checkpoint, dequantized by transformers on load (its config's
    `dequantize`) into the float32 model. On a CPU-only machine transformers does that by itself; where CUDA is
    visible it would keep its FP8Linear, whose forward needs the `kernels` package's Triton kernel from the Hub
    (not on the GPU machine's image, which cannot download it): the oracle is the same function either way."""
    from transformers import FineGrainedFP8Config

    stored = json.loads((directory / "config.json").read_text())["quantization_config"]
    dequantized = FineGrainedFP8Config.from_dict({**stored, "dequantize": True})
    return Oracle(directory, adapters, quantization_config=dequantized)


def write_compressed_tensors(src: Path, dst: Path, *, preset: str, calibration: list[list[int]],
                             actorder: str | None = None) -> Path:
    """`src` (fp32) quantized by compressed-tensors' preset ("FP8": per-tensor weights, static per-tensor input
    scales; "FP8_DYNAMIC": per-channel weights, dynamic per-token activations; "W4A16": 4-bit integers per group
    of 128, pack-quantized) and written by its compressor. actorder: the weights' (llm-compressor's GPTQModifier
    writes "static" by default).
    Also writes dst/producer_logits.pt: (the first calibration prompt, the logits of the quantized model that
    wrote the checkpoint on it, compressed-tensors' own forward), what the oracle is checked against."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for name, module in list(model.named_modules()):
        if _is_stacked_experts(module):  # as llm-compressor calibrates an MoE: one Linear per expert and projection
            model.set_submodule(name, LinearExperts(module, ("w1", "w3", "w2") if "Mixtral" in type(model).__name__
                                                    else ("gate_proj", "up_proj", "down_proj")))
    input_amax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, args, name=name: input_amax.__setitem__(name, max(input_amax.get(name, 0.0),
                                                                    float(args[0].abs().amax()))))
        for name, module in model.named_modules() if _is_projection(f"{name}.weight")]
    with torch.no_grad():
        for prompt in calibration:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if actorder is not None:
        scheme.weights = QuantizationArgs(**{**scheme.weights.model_dump(), "actorder": actorder})
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if scheme.weights.strategy == "group":  # [out, groups]
            weight = weight.reshape(weight.shape[0], -1, scheme.weights.group_size)
            low, high = weight.amin(-1), weight.amax(-1)
        elif scheme.weights.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale, _ = calculate_qparams(low, high, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            assert name in input_amax, f"{name} saw no calibration tokens"
            module.input_scale.data.fill_(input_amax[name] / 448.0)
        module.quantization_status = QuantizationStatus.FROZEN
    with torch.no_grad():
        producer = (calibration[0], model(torch.tensor([calibration[0]])).logits[0].float())
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    torch.save(producer, dst / "producer_logits.pt")
    for path in src.iterdir():
        if path.name.startswith("tokenizer"):
            shutil.copy(path, dst / path.name)
    return dst


def _is_stacked_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and hasattr(module, "act_fn")


class LinearExperts(nn.ModuleList):
    """transformers' stacked experts (gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I]) as one module of
    Linears per expert, named as the checkpoint names them (`names`: gate, up, down), computing the same."""

    def __init__(self, stacked: nn.Module, names: tuple[str, str, str]) -> None:
        experts, rows, hidden = stacked.gate_up_proj.shape
        inter = rows // 2
        super().__init__(nn.ModuleDict({names[0]: nn.Linear(hidden, inter, bias=False),
                                        names[1]: nn.Linear(hidden, inter, bias=False),
                                        names[2]: nn.Linear(inter, hidden, bias=False)}) for _ in range(experts))
        self.names = names
        object.__setattr__(self, "act", stacked.act_fn)  # not a child: the list's children are the experts alone
        for e, expert in enumerate(self):
            expert[names[0]].weight.data.copy_(stacked.gate_up_proj.data[e, :inter])
            expert[names[1]].weight.data.copy_(stacked.gate_up_proj.data[e, inter:])
            expert[names[2]].weight.data.copy_(stacked.down_proj.data[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate, up, down = self.names
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token, choice = torch.where(top_k_index == e)
            if len(token):
                x = hidden_states[token]
                y = expert[down](self.act(expert[gate](x)) * expert[up](x))
                out.index_add_(0, token, y * top_k_weights[token, choice, None])
        return out


def quantize_expert_inputs(model: nn.Module, directory: Path) -> None:
    """Make transformers' experts in `model` (loaded from the compressed-tensors checkpoint at `directory`, maybe
    under PEFT) quantize each projection's input as compressed-tensors' forward quantizes a Linear's: fake-quantized
    to fp8 per token (dynamic) or with the expert's input_scale (static), by compressed-tensors' own functions. A
    PEFT adapter on the experts (target_parameters) adds its delta on the unquantized input, as it does on a
    quantized Linear (its LoRA layer beside the base layer)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    group = json.loads((directory / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    args = QuantizationArgs(**group["input_activations"])
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys() if name.endswith(".input_scale")}

    def quantize(x: torch.Tensor, scale_name: str) -> torch.Tensor:
        if args.dynamic:  # [1, rows, D]: compressed-tensors reduces per token over a 3-D input only
            scale, zero = compute_dynamic_scales_and_zp(x[None], args, module=None)
            return fake_quantize(x[None], scale, None, args)[0]
        return fake_quantize(x, stored[scale_name], None, args)

    mixtral = any(".block_sparse_moe." in key for key in stored) or "Mixtral" in str(type(model))
    for name, module in model.named_modules():
        if _is_stacked_experts(module) and not hasattr(module, "base_layer"):  # not PEFT's wrapper of it
            prefix = re.sub(r"(\.base_layer)+$", "", name[name.index("model.layers."):])  # as the checkpoint names
            if mixtral:
                prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
            names = ("w1", "w2") if mixtral else ("gate_proj", "down_proj")
            module.forward = types.MethodType(_quantized_experts_forward(prefix, names, quantize), module)  # bound:
            # compressed-tensors wraps each module's forward.__func__ on the first forward


def _lora_split(module: nn.Module, name: str):
    """(the parameter as stored, PEFT's delta on it or None): PEFT parametrizes a targeted parameter while its
    adapter is active, each parametrization adding its delta."""
    parametrizations = getattr(module, "parametrizations", {})
    if name not in parametrizations:
        return getattr(module, name), None
    original = parametrizations[name].original
    delta = sum(proxy(torch.zeros_like(original)) for proxy in parametrizations[name])
    return original, delta


def _quantized_experts_forward(prefix: str, names: tuple[str, str], quantize):
    def forward(module, hidden_states, top_k_index, top_k_weights):
        (gate_up, gate_up_delta), (down, down_delta) = (_lora_split(module, "gate_up_proj"),
                                                        _lora_split(module, "down_proj"))
        out = torch.zeros_like(hidden_states)
        for e in range(gate_up.shape[0]):
            token, choice = torch.where(top_k_index == e)
            if not len(token):
                continue
            x = hidden_states[token]
            h = nn.functional.linear(quantize(x, f"{prefix}.{e}.{names[0]}.input_scale"), gate_up[e])
            if gate_up_delta is not None:
                h = h + nn.functional.linear(x, gate_up_delta[e])
            gate, up = h.chunk(2, dim=-1)
            a = module.act_fn(gate) * up
            y = nn.functional.linear(quantize(a, f"{prefix}.{e}.{names[1]}.input_scale"), down[e])
            if down_delta is not None:
                y = y + nn.functional.linear(a, down_delta[e])
            out.index_add_(0, token, y * top_k_weights[token, choice, None])
        return out

    return forward
