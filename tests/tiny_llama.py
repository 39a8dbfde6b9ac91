"""Tiny random Llama and Phi-3 checkpoints with a word-level tokenizer, and PEFT adapters made for them by PEFT.

torch, transformers and PEFT are imported where used, so tests that need no model start fast.
"""

import io
import zipfile
from pathlib import Path


def tiny_llama_config(hidden_size: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def tiny_phi3_config():
    """Phi-3's shape at the tiny Llama's size: fused qkv_proj [32 + 2 * 16, 32] and gate_up_proj [2 * 64, 32]."""
    from transformers import Phi3Config

    return Phi3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=128, pad_token_id=0, architectures=["Phi3ForCausalLM"],
    )  # fmt: skip


def save_tiny_base(directory: Path, *, phi3: bool = False) -> Path:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaForCausalLM, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(tiny_phi3_config()) if phi3 else LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(directory, safe_serialization=True)
    words = ["[UNK]", *[f"w{i}" for i in range(63)]]
    tokenizer = Tokenizer(WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def save_peft_adapter(directory: Path, *, seed: int, hidden_size: int = 32, rank: int = 4) -> Path:
    """A PEFT LoRA (q, v and down projections, B not zero) for the tiny base, or for a wider one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size))
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                      init_lora_weights=False)  # fmt: skip
    get_peft_model(model, lora).save_pretrained(directory)
    return directory


def save_phi3_adapter(directory: Path, *, seed: int, fused: bool, targets: list[str] | None = None) -> Path:
    """A PEFT LoRA for the tiny Phi-3: on its own fused modules, or (fused=False) made on a Llama of the same
    widths, as for a Phi-3 whose q/k/v and gate/up were split, so with the split names."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Phi3ForCausalLM

    torch.manual_seed(seed)
    model = Phi3ForCausalLM(tiny_phi3_config()) if fused else LlamaForCausalLM(tiny_llama_config())
    default = ["qkv_proj", "gate_up_proj"] if fused else ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets or default, init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(directory)
    return directory


def zipped(directory: Path) -> bytes:
    """The folder's files in one zip, as a user would upload them."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(directory).as_posix())
    return buffer.getvalue()
