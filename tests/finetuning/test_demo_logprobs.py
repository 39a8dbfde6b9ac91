"""Log-probabilities of the byte-level demo model through the live gateway and the `openai` package. They ride the
fine-tuning stack because it serves the demo model, whose byte-level BPE splits characters it never saw into one
token per byte (the gateway package's stack serves a word-level tokenizer): such a token reads as its own raw bytes,
not as U+FFFD, and the end token as the model's own."""

import re

import pytest
from tokenizers import Tokenizer

from tests.finetuning.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

PARTIAL = re.compile(r"^bytes:((?:\\x[0-9a-f]{2})+)$")


def _raw(token: str) -> bytes:
    """A legacy-completions token as bytes: `bytes:\\xe2...` for part of a character, else its text."""
    match = PARTIAL.match(token)
    return bytes.fromhex(match.group(1).replace("\\x", "")) if match else token.encode()


def test_tokens_that_split_a_character_show_their_own_bytes(ft_stack):
    tokenizer = Tokenizer.from_file(str(ft_stack.model_dir / "tokenizer.json"))
    text = "a € sign"
    ids = tokenizer.encode(text).ids
    answer = client(ft_stack, "main").completions.create(
        model=BASE_MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=1, temperature=0
    )
    tokens = answer.choices[0].logprobs.tokens[: len(ids)]
    assert any(PARTIAL.match(token) for token in tokens), tokens
    assert b"".join(_raw(token) for token in tokens) == text.encode()
    assert answer.choices[0].text.startswith(text)


def test_the_end_token_reads_as_the_models_own(ft_stack):
    tokenizer = Tokenizer.from_file(str(ft_stack.model_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")  # the demo tokenizer's own end token (tokenizer_config.json's eos_token)
    answer = client(ft_stack, "main").completions.create(
        model=BASE_MODEL, prompt=[eos, eos], echo=True, logprobs=0, max_tokens=1, temperature=0
    )
    assert answer.choices[0].logprobs.tokens[:2] == ["</s>", "</s>"]
