"""A byte-level BPE tokenizer trained on the demo corpus, with a chat template."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Tools in the Hermes convention (as Qwen's templates): offered in a system turn, one line each as
# name(parameter, ...) (the demo's context is 256 tokens), called as <tool_call>\n{"name": ..., "arguments":
# {...}}\n</tool_call>, answered in <tool_response>. Without tools, the chat renders as it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>functions:"
    "{% for tool in tools %} {{ tool.function.name }}({{ (tool.function.parameters or {}).get('properties', {}) "
    "| list | join(', ') }}){% endfor %}; call one as <tool_call>{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|user|><tool_response>\n{{ message['content'] }}\n</tool_response>{{ eos_token }}"
    "{% elif message.tool_calls %}<|assistant|>{{ message['content'] or '' }}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(lines: list[str], *, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path, *, max_length: int) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def chat_prompt(user: str) -> str:
    """The chat template applied to one user message, with the generation prompt (as text)."""
    return f"{BOS}<|user|>{user}{EOS}<|assistant|>"
