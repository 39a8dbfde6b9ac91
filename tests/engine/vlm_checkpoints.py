"""Tiny random vision-language checkpoints built with transformers, in either layout, their tokenizer and
image processor, and PEFT LoRAs on the language model's seven projections."""

import json

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
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


def build_qwen2_5_vl(directory, *, seed: int, layout: str = "hub"):
    """layout "hub": what save_pretrained writes (model.layers.*, visual.*, preprocessor_config.json,
    chat_template.json); "transformers5": model.language_model.*, model.visual.*, processor_config.json,
    chat_template.jinja."""
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.15,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1], "initializer_range": 0.15},
        image_token_id=IMAGE_TOKEN, video_token_id=153, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms away from their initial ones, so that a missed one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 24)
    if layout == "hub":
        processor.save_pretrained(directory)
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    else:
        stored = load_file(directory / "model.safetensors")
        renamed = {}
        for name, tensor in stored.items():
            if name.startswith("model."):
                name = "model.language_model." + name[len("model."):]
            elif name.startswith("visual."):
                name = "model." + name
            renamed[name] = tensor
        save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "processor_config.json").write_text(json.dumps(
            {"image_processor": processor.to_dict(), "processor_class": "Qwen2_5_VLProcessor"}))
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def build_vlm_adapter(base_dir, directory, *, seed: int, r: int, targets=LANGUAGE_MODEL_PROJECTIONS):
    """A PEFT LoRA, by default on the language model's seven projections, A and B random (PEFT starts B at
    zero)."""
    torch.manual_seed(seed)
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(base_dir)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=targets))
    for name, param in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.2)
    peft_model.save_pretrained(directory)
    return directory
