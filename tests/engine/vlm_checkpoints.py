"""Tiny random vision-language checkpoints built with transformers, in either layout, their tokenizer and
image processor, and PEFT LoRAs on the language model's seven projections."""

import json

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

VOCAB = 160
IMAGE_TOKEN, VISION_START, VISION_END = 150, 151, 152
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LANGUAGE_MODEL_PROJECTIONS = rf".*language_model.*\.({'|'.join(PROJECTIONS)})"  # not the vision tower's MLP
# Qwen's template for content parts: an image part is <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }} {% else %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer(directory) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    specials = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "user": 3, "assistant": 4, "system": 5,
                "<|image_pad|>": IMAGE_TOKEN, "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END}
    for name, i in specials.items():
        del vocab[f"w{i}"]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>",
                            "<|vision_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def vlm_config(family: str):
    """A tiny config of `family` ("qwen2_5_vl", "qwen3_vl") whose vision tower has windows or deepstack layers."""
    text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.15,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
              "initializer_range": 0.15}
    tokens = {"image_token_id": IMAGE_TOKEN, "video_token_id": 153, "vision_start_token_id": VISION_START,
              "vision_end_token_id": VISION_END}
    if family == "qwen2_5_vl":
        vision |= {"patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=1, eos_token_id=2, **tokens)
    text |= {"head_dim": 16, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
    vision |= {"patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)


MODELS = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}
PROCESSORS = {"qwen2_5_vl": {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 24},
              "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                           "min_pixels": 32 * 32 * 2, "max_pixels": 32 * 32 * 24}}


def layout_name(name: str, layout: str) -> str:
    """A checkpoint tensor's name in `layout`, from either."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        name = old + name[len(new):] if name.startswith(new) else name  # to the Hub's names first
    if layout == "hub":
        return name
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def build_vlm(directory, family: str, *, seed: int, layout: str = "hub"):
    """layout "hub": the older Hub files (model.layers.*, visual.*, preprocessor_config.json,
    chat_template.json); "transformers5": model.language_model.*, model.visual.*, processor_config.json,
    chat_template.jinja."""
    torch.manual_seed(seed)
    model = MODELS[family](vlm_config(family)).eval()
    with torch.no_grad():  # norms away from their initial ones, so that a missed one shows
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    processor = Qwen2VLImageProcessorPil(**PROCESSORS[family])
    stored = load_file(directory / "model.safetensors")
    renamed = {layout_name(name, layout): tensor for name, tensor in stored.items()}
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
    if layout == "hub":
        processor.save_pretrained(directory)
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    else:
        (directory / "processor_config.json").write_text(json.dumps(
            {"image_processor": processor.to_dict(), "processor_class": "Qwen2_5_VLProcessor"}))
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def build_vlm_adapter(base_dir, directory, *, seed: int, r: int, targets=LANGUAGE_MODEL_PROJECTIONS):
    """A PEFT LoRA, by default on the language model's seven projections, A and B random (PEFT starts B at
    zero)."""
    torch.manual_seed(seed)
    base = MODELS[json.loads((base_dir / "config.json").read_text())["model_type"]].from_pretrained(base_dir)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=targets))
    for name, param in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.2)
    peft_model.save_pretrained(directory)
    return directory
