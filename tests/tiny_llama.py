"""A tiny random Llama checkpoint with a word-level tokenizer, and PEFT adapters made for it by PEFT itself.

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


def save_tiny_base(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory, safe_serialization=True)
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


def zipped(directory: Path) -> bytes:
    """The folder's files in one zip, as a user would upload them."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(directory).as_posix())
    return buffer.getvalue()
