"""Test data for the console: a tiny random Llama base, PEFT adapters made for it by PEFT, usage events.

torch, transformers and PEFT are imported where used, so page tests that need no model start fast.
"""

import io
import zipfile
from datetime import UTC, datetime
from itertools import count
from pathlib import Path

BASE_NAME = "tiny-llama"
_request_ids = count(1)


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=128, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def save_tiny_base(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(directory, safe_serialization=True)
    words = ["[UNK]", *[f"w{i}" for i in range(63)]]
    tokenizer = Tokenizer(WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def peft_adapter_zip(directory: Path, *, seed: int, rank: int = 4) -> bytes:
    """A PEFT LoRA for the tiny base (q, v and down projections), zipped as a user would upload it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                      init_lora_weights=False)  # fmt: skip
    get_peft_model(LlamaForCausalLM(tiny_config()), lora).save_pretrained(directory)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(directory).as_posix())
    return buffer.getvalue()


def usage_event(tenant, *, model: str = BASE_NAME, api_key=None, finished_at: datetime | None = None, **fields) -> dict:
    """One usage event as the engine sends it to `metering.ingest_usage` (see notes/interfaces)."""
    return {
        "request_id": f"console-req-{next(_request_ids):08d}",
        "tenant": str(tenant.pk),
        "api_key_id": api_key.pk if api_key else None,
        "adapter": None,
        "base_model": BASE_NAME,
        "prompt_tokens": 1200,
        "cached_tokens": 200,
        "completion_tokens": 300,
        "gpu_ms": 80.0,
        "queue_ms": 2.0,
        "ttft_ms": 12.0,
        "e2e_ms": 90.0,
        "finish_reason": "stop",
        "finished_at": (finished_at or datetime.now(UTC)).isoformat(),
        "engine": "engine-1",
        "metadata": {"model": model, "tenant_id": tenant.pk, "api_key_id": api_key.pk if api_key else None},
        **fields,
    }
