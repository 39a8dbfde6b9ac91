"""Tiny random vision-language checkpoints built with transformers, in either layout, their tokenizer and
image processor, and PEFT LoRAs on the language model's seven projections."""

import json

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
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

# Gemma 3's: a part typed "image" (only) is <start_of_image>, which its processor replaces by
# "\n\n<start_of_image>" + <image_soft_token> * mm_tokens_per_image + "<end_of_image>\n\n"
GEMMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image> {% elif part['type'] == 'text' %}{{ part['text'] }} "
    "{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)
GEMMA3_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 3, "<end_of_turn>": 4,
                   "<image_soft_token>": IMAGE_TOKEN, "<start_of_image>": VISION_START, "<end_of_image>": VISION_END}
GEMMA3_WORDS = {"user": 5, "model": 6, "\n\n": 153}
GEMMA3_IMAGE_TOKENS = 16  # mm_tokens_per_image of the tiny Gemma 3


def build_gemma3_tokenizer(directory) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    for name, i in {**GEMMA3_SPECIALS, **GEMMA3_WORDS}.items():
        del vocab[f"w{i}"]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(GEMMA3_SPECIALS))
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "boi_token": "<start_of_image>",
              "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


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
    """A tiny config of `family` ("qwen2_5_vl", "qwen3_vl", "gemma3") whose vision tower has windows or deepstack
    layers (Qwen) or whose images are wider than the sliding window (Gemma 3)."""
    text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.15,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
              "initializer_range": 0.15}
    tokens = {"image_token_id": IMAGE_TOKEN, "video_token_id": 153, "vision_start_token_id": VISION_START,
              "vision_end_token_id": VISION_END}
    if family == "gemma3":  # a sliding window narrower than an image, so both bound its tokens' attention
        text |= {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "bos_token_id": 2,
                 "eos_token_id": 4, "pad_token_id": 0,
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
        vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": 4, "vision_use_head": False}
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                            image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START, eoi_token_index=VISION_END,
                            initializer_range=0.15)
    if family == "qwen2_5_vl":
        vision |= {"patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=1, eos_token_id=2, **tokens)
    text |= {"head_dim": 16, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
    vision |= {"patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)


MODELS = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration,
          "gemma3": Gemma3ForConditionalGeneration}
PROCESSORS = {"qwen2_5_vl": {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 24},
              "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                           "min_pixels": 32 * 32 * 2, "max_pixels": 32 * 32 * 24},
              "gemma3": {"size": {"height": 32, "width": 32}}}
PROCESSOR_CLASSES = {"gemma3": Gemma3ImageProcessorPil}


def layout_name(name: str, layout: str) -> str:
    """A checkpoint tensor's name in `layout`, from either."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        name = old + name[len(new):] if name.startswith(new) else name  # to the Hub's names first
    if layout == "hub":
        return name
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


GEMMA3_PARTS = {"text": ("model.language_model.", "language_model.model."),
                "vision": ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                           "vision_tower."),
                "projector": ("model.multi_modal_projector.", "multi_modal_projector.")}
GEMMA3_LAYOUTS = {"hub": {"text": "language_model.model.", "vision": "vision_tower.vision_model.",
                          "projector": "multi_modal_projector."},
                  "transformers5": {"text": "model.language_model.", "vision": "model.vision_tower.",
                                    "projector": "model.multi_modal_projector."}}


def gemma3_layout_name(name: str, layout: str) -> str:
    """A Gemma 3 checkpoint tensor's name in `layout`, from any."""
    for part, prefixes in GEMMA3_PARTS.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                return GEMMA3_LAYOUTS[layout][part] + name[len(prefix):]
    return name


def build_vlm(directory, family: str, *, seed: int, layout: str = "hub", config=None, processor_settings=None):
    """layout "hub": the older Hub files (model.layers.*, visual.*, preprocessor_config.json,
    chat_template.json); "transformers5": model.language_model.*, model.visual.*, processor_config.json,
    chat_template.jinja. config, processor_settings: another shape than the tiny one (vlm_config, PROCESSORS)."""
    torch.manual_seed(seed)
    model = MODELS[family](config or vlm_config(family)).eval()
    with torch.no_grad():  # norms away from their initial ones, so that a missed one shows
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if "mm_input_projection_weight" in name:  # Gemma 3's projector starts at zero: images would be blank
                param.normal_(std=0.2)
    model.save_pretrained(directory)
    gemma = family == "gemma3"
    (build_gemma3_tokenizer if gemma else build_tokenizer)(directory)
    template = GEMMA3_CHAT_TEMPLATE if gemma else CHAT_TEMPLATE
    processor = PROCESSOR_CLASSES.get(family, Qwen2VLImageProcessorPil)(**(processor_settings or PROCESSORS[family]))
    stored = load_file(directory / "model.safetensors")
    renamed = {(gemma3_layout_name if gemma else layout_name)(name, layout): tensor for name, tensor in stored.items()}
    save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
    if layout == "hub":
        processor.save_pretrained(directory)
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    else:
        (directory / "processor_config.json").write_text(json.dumps(
            {"image_processor": processor.to_dict(),
             "processor_class": "Gemma3Processor" if gemma else "Qwen2_5_VLProcessor"}))
        (directory / "chat_template.jinja").write_text(template)
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
