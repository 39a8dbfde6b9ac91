"""Tokens as a client reads them in log-probabilities: the raw bytes of a token that is part of a UTF-8 character
(not those of U+FFFD), and special tokens (the end token) as the model's own tokenizer writes them."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.contract.events import Delta as DeltaEvent
from engine.contract.events import Logprob
from engine.demo import corpus
from engine.demo.tokenizer import train_tokenizer
from gateway.engine_events import delta_of
from gateway.openai_response import ResponseBuilder
from gateway.token_text import Vocabulary

EURO = "€"  # three bytes: e2 82 ac


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    tokenizer = train_tokenizer(corpus.tokenizer_corpus(random.Random(0), lines=50), vocab_size=400)
    tokenizer.add_special_tokens(["<|im_end|>"])
    return tokenizer


def test_a_token_that_splits_a_character_has_its_own_bytes(byte_level):
    vocabulary = Vocabulary(byte_level)
    ids = byte_level.encode(EURO).ids
    assert len(ids) > 1  # the corpus never saw it: one token per byte
    pieces = [vocabulary.piece(t) for t in ids]
    assert b"".join(p.bytes for p in pieces) == EURO.encode()
    assert pieces[0].bytes == b"\xe2" and not pieces[0].whole and pieces[0].text == "\\xe2"


def test_whole_tokens_and_the_end_token_read_as_the_model_writes_them(byte_level):
    vocabulary = Vocabulary(byte_level)
    (the,) = byte_level.encode("the").ids
    assert vocabulary.piece(the) == vocabulary.piece(the).__class__(text="the", bytes=b"the", whole=True)
    spaced = byte_level.encode(" the").ids
    assert b"".join(vocabulary.piece(t).bytes for t in spaced) == b" the"
    end = byte_level.token_to_id("<|im_end|>")
    assert vocabulary.piece(end).text == "<|im_end|>"
    assert vocabulary.piece(byte_level.token_to_id("</s>")).text == "</s>"


def test_sentencepiece_byte_fallback_tokens_carry_their_byte():
    vocab = {"<unk>": 0, "</s>": 1, "<0xE2>": 2, "▁the": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Metaspace()
    vocabulary = Vocabulary(tokenizer)
    assert vocabulary.piece(2).bytes == b"\xe2" and not vocabulary.piece(2).whole


def test_logprobs_show_the_raw_bytes_in_both_apis(byte_level):
    vocabulary = Vocabulary(byte_level)
    first = byte_level.encode(EURO).ids[0]
    event = DeltaEvent(request_id="r", index=0, text="", token_ids=[first],
                       logprobs=[Logprob(token_id=first, logprob=-0.5, top={first: -0.5})])
    delta = delta_of(event, vocabulary=vocabulary)
    for kind in ("chat", "completion"):
        builder = ResponseBuilder(kind=kind, request_id="r", model="m", n=1, logprobs=True)
        builder.apply(delta)
        logprobs = builder.body()["choices"][0]["logprobs"]
        if kind == "chat":
            entry = logprobs["content"][0]
            assert entry["bytes"] == [0xE2] and entry["top_logprobs"][0]["bytes"] == [0xE2]
        else:
            assert logprobs["tokens"] == ["bytes:\\xe2"] and logprobs["top_logprobs"] == [{"bytes:\\xe2": -0.5}]
