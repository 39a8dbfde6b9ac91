"""A byte-level BPE checkpoint folder (tokenizer.json + tokenizer_config.json) built in code, shaped like Llama 3's and
Qwen's: a split regex then byte-level bytes, NFC, a begin-of-text token the post-processor adds, ChatML turns with
Hermes tools, and added tokens of both kinds (special, and plain ones matched after normalization). For the prompt
counting test and benchmarks/gateway_tokenize.py; the demo tokenizer (var/demo-model) is GPT-2's shape instead."""

import json
import random
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

BEGIN, START, END = "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")  # fmt: skip
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' }}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("the tenant adapter serves requests tokens quota budget stream latency kernel page cache model weight "
         "naïve café straße Ελληνικά русский 日本語 中文 한국어 العربية 🙂 🚀 x=y+z; f(a,b) {'k': [1, 2]} "
         "don't it's we're 12345 3.14159 0xFF\tTAB\n\nnewlines").split(" ")  # fmt: skip


SYLLABLES = "ka to ri mu sen dal or ing tion pre str ve qu ab el ix on ur ge ly".split()


def corpus(rng: random.Random, *, lines: int) -> list[str]:
    """Lines of the words above and made-up ones (enough distinct words for a vocabulary of thousands)."""
    made = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choice(WORDS) if rng.random() < 0.3 else rng.choice(made) for _ in range(rng.randint(3, 30)))
            for _ in range(lines)]  # fmt: skip


def build_bpe_checkpoint(directory: Path, *, vocab_size: int = 4000, seed: int = 0) -> Path:
    """Writes the tokenizer into `directory` (made if missing) and returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BEGIN, START, END], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(corpus(random.Random(seed), lines=3000), trainer=trainer)
    tokenizer.add_tokens([AddedToken("<tool_call>", normalized=False), AddedToken("</tool_call>", normalized=False),
                          AddedToken("<|im", normalized=False),  # a prefix of two special tokens: longest wins
                          AddedToken("<tool_response>"), AddedToken("</tool_response>")])  # fmt: skip
    begin = tokenizer.token_to_id(BEGIN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BEGIN} $A", pair=f"{BEGIN} $A {BEGIN} $B",
                                      special_tokens=[(BEGIN, begin)]),
    ])  # fmt: skip
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BEGIN, "eos_token": END, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
