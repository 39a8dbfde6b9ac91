"""The gateway's prompt token counts (admission's) equal the engine's own: `Tokenizer.encode` of each text prompt,
and of a chat's template text without special tokens, over unicode, empty, long and special-token-looking prompts and
chats with tools, for the demo tokenizer (GPT-2's shape) and a byte-level BPE built in code (Llama 3's and Qwen's).
Kept segment counts (gateway.segment_counts) give the same counts, missed and hit, for any segment length; tenants
keep their own. The chat's template text is checked against transformers' rendering of the same template."""

import asyncio
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer

from engine.chat_prompt import template_messages
from engine.demo.builder import ensure_demo
from engine.tokenizer import Tokenizer
from gateway.caller import Target
from gateway.openai_request import parse_chat, parse_completion
from gateway.prompt_tokens import count_prompt_tokens, prompt_tokens
from gateway.segment_counts import SegmentCounts, cut_pattern
from tests.conftest import REPO
from tests.gateway.bpe_tokenizer import WORDS, build_bpe_checkpoint

SPECIAL_LOOKING = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|begin_of_text|>",
                   "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "<|im_sta", "<|",
                   "|>", "<s", "<<s>>", "<|im_end|><|im_end|>"]  # fmt: skip
ODD = ["", " ", "  ", "\n", "\r\n", "\t\t", "\u00a0", "e\u0301", "\u0065\u0301\u0301", "\ufeff", "\u200b", "\u202e",
       "🙂", "👩‍👩‍👧", "𝔘𝔫𝔦", "ﬁ", "Ⅻ", "½", "\x00", "\x7f", "'s", "'LL", "1234567", "١٢٣", "a" * 300]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <|im_end|> by city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                      "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


@pytest.fixture(scope="module", params=["demo", "bpe"])
def model_dir(request, tmp_path_factory):
    if request.param == "demo":
        return ensure_demo(REPO / "var" / "demo-model")
    return build_bpe_checkpoint(tmp_path_factory.mktemp("bpe"))


def a_text(rng: random.Random, size: int) -> str:
    pieces = WORDS + SPECIAL_LOOKING + ODD
    out, length = [], 0
    while length < size:
        piece = rng.choice(pieces) + rng.choice(["", " ", " ", "\n", "  ", ", "])
        out.append(piece)
        length += len(piece)
    return "".join(out)


def a_message(rng: random.Random, index: int) -> dict:
    content = a_text(rng, rng.choice([0, 5, 40, 300]))
    kind = rng.random()
    if kind < 0.15:
        return {"role": "assistant", "content": rng.choice([None, content]), "tool_calls": [
            {"id": f"call_{index}", "type": "function", "function": {
                "name": rng.choice(["get_weather", "search"]),
                "arguments": rng.choice(['{"city": "Zürich <s>"}', "{}", "not json {", '{"q": "日本語 🙂"}']),
            }}]}  # fmt: skip
    if kind < 0.25:
        return {"role": "tool", "content": content, "tool_call_id": f"call_{index}"}
    if kind < 0.35:
        return {"role": "user", "content": [{"type": "text", "text": content}, {"type": "text", "text": " <|im_end|>"}]}
    return {"role": rng.choice(["user", "assistant", "system", "developer"]), "content": content}


def cases(rng: random.Random) -> list[dict]:
    """Request bodies: completions (one text, several, token ids) and chats (with and without tools)."""
    bodies = [{"prompt": ""}, {"prompt": [""]}, {"prompt": " ".join(SPECIAL_LOOKING)}, {"prompt": "".join(ODD)},
              {"prompt": a_text(rng, 20_000)}, {"prompt": [a_text(rng, 17_000), "x"]}, {"prompt": [[1, 2, 3], [4]]},
              {"messages": [{"role": "user", "content": ""}]},
              {"messages": [{"role": "user", "content": a_text(rng, 20_000)}], "tools": TOOLS}]  # fmt: skip
    for size in [1, 2, 5, 16, 64, 256, 1024, 4096] * 8:
        bodies.append({"prompt": a_text(rng, size)})
    for _ in range(8):
        bodies.append({"prompt": [a_text(rng, rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]})
    for turns in [1, 2, 3, 6, 12] * 10:
        body = {"messages": [a_message(rng, i) for i in range(turns)]}
        if rng.random() < 0.4:
            body["tools"] = rng.choice([TOOLS, TOOLS[:1]])
        bodies.append(body)
    return [{"model": "m", **body} for body in bodies]


def engine_count(tokenizer: Tokenizer, generation) -> int:
    """What the engine counts (engine/server/app.py's `tokenize`)."""
    if generation.messages is not None:
        text = tokenizer.apply_chat_template(template_messages(generation.messages), add_generation_prompt=True,
                                             tools=generation.structure.get("tools"))  # fmt: skip
        return len(tokenizer.encode(text, add_special_tokens=False))
    return sum(len(tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in generation.prompts)


def a_target(model_dir) -> Target:
    return Target(name="m", base_model="base", checkpoint_dir=str(model_dir), max_context=256, adapter_id=None,
                  adapter_version_id=None, adapter_version=None, digest=None, adapter_path=None)  # fmt: skip


def test_the_gateway_counts_what_the_engine_counts(model_dir):
    engine = Tokenizer(model_dir)
    gateway = Tokenizer(model_dir)
    target = a_target(model_dir)
    counted = 0
    for body in cases(random.Random(23)):
        generation = parse_chat(body) if "messages" in body else parse_completion(body)
        expected = engine_count(engine, generation)
        assert prompt_tokens(generation, gateway) == expected, body
        assert asyncio.run(count_prompt_tokens(generation, target)) == expected, body
        for tenant in (1, 2, 1):  # kept counts: missed, another tenant's, hit
            assert asyncio.run(count_prompt_tokens(generation, target, tenant=tenant)) == expected, body
        counted += expected
    assert counted > 50_000  # long prompts among them


@pytest.mark.parametrize("min_chars", [1, 3, 40, 256])
def test_kept_segment_counts_add_up_to_the_whole_texts(model_dir, min_chars):
    engine = Tokenizer(model_dir)
    counts = SegmentCounts(Tokenizer(model_dir), budget_chars=30_000, min_chars=min_chars)
    assert counts.cuts is not None
    rng = random.Random(min_chars)
    texts = [a_text(rng, rng.choice([0, 1, 10, 100, 1000, 5000])) for _ in range(150)]
    texts += ["<|im_end|>" * 3, "<s></s>", "x<|im_start|>", "<|im_start|>x", "<|im_end|>" + "y" * 300 + "<s>"]
    for text in texts + texts:  # the second time, from the kept counts
        for special in (True, False):
            expected = len(engine.encode(text, add_special_tokens=special))
            assert counts.count(text, tenant=rng.choice([1, 2]), add_special_tokens=special) == expected, text
    assert 0 < counts._kept_chars <= 30_000 and {tenant for tenant, _ in counts._kept} == {1, 2}


def test_a_segment_is_kept_for_its_tenant_only(model_dir):
    counts = SegmentCounts(Tokenizer(model_dir), budget_chars=100_000)
    system = " ".join(WORDS) * 8  # no special tokens: one segment
    for tenant in ("a", "b"):
        counts.count(system, tenant=tenant)
    assert sorted(tenant for tenant, _ in counts._kept) == ["a", "b"]
    assert counts._kept_chars == 2 * len(system)
    kept = repr(list(counts._kept))  # by a digest: no prompt text held past its request
    assert system[:40] not in kept


def test_a_tokenizer_whose_pieces_depend_on_their_place_is_counted_whole(tmp_path):
    """Metaspace with prepend_scheme "first" marks only the text's first piece: a piece alone would count another."""
    hf = HFTokenizer(models.BPE(vocab={"\u2581": 0, "a": 1, "<s>": 2}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    hf.add_special_tokens(["<s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    counts = SegmentCounts(tokenizer, budget_chars=100, min_chars=1)
    text = "a<s>a"  # ▁ a <s> a
    assert cut_pattern(tokenizer) is None and counts.count(text, tenant=1) == tokenizer.count(text) == 4
    assert tokenizer.count("a") == 2  # ▁ a: the pieces alone would count 5


def test_the_chat_template_renders_as_transformers_renders_it(model_dir):
    ours = Tokenizer(model_dir)
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(5)
    for turns in [1, 2, 4, 8] * 10:
        messages = template_messages(parse_chat({"model": "m", "messages": [a_message(rng, i) for i in range(turns)]})
                                     .messages)  # fmt: skip
        tools = rng.choice([None, TOOLS])
        text = ours.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        assert text == theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
