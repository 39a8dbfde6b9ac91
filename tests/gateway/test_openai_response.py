"""Stream chunks as OpenAI writes them: each one a compact JSON object, whichever way the builder wrote its bytes."""

import json

import pytest

from gateway.openai_response import FINISH_REASONS, Delta, ResponseBuilder

TEXTS = ["", " w", 'say "hi"\n', "tab\tand \\ backslash", "caf\u00e9 \u2603 \U0001f600", "\x00\x1f control", "\ud83d"]


def _expected(kind: str, builder: ResponseBuilder, choice: dict, *, with_usage_field: bool) -> bytes:
    chunk = {
        "id": builder.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": builder.created, "model": builder.model, "system_fingerprint": None, "choices": [choice],
    }  # fmt: skip
    if with_usage_field:
        chunk["usage"] = None
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("with_usage_field", [False, True], ids=["no-usage-field", "usage-field"])
@pytest.mark.parametrize("model", ["bench", 'odd "model" \u00e9'], ids=["plain-model", "odd-model"])
def test_text_chunks_after_the_first_are_openai_shaped_json(kind, with_usage_field, model):
    builder = ResponseBuilder(kind=kind, request_id="0f" * 16, model=model, n=2, logprobs=False)
    for index in (0, 1):  # each choice's first chunk (the role, the echo) takes the general path
        builder.chunk(Delta(index=index, text="", logprobs=[], finish_reason=None), with_usage_field=with_usage_field)
    for index in (1, 0):
        for text in TEXTS:
            for reason in [None, *FINISH_REASONS, "something-new"]:
                if not text and reason is None:
                    continue  # nothing to send
                delta = Delta(index=index, text=text, logprobs=[], finish_reason=reason, tokens=1)
                finish = FINISH_REASONS.get(reason, "stop") if reason else None
                content = {"delta": {"content": text}} if kind == "chat" else {"text": text}
                choice = {"index": index, **content, "logprobs": None, "finish_reason": finish}
                got = builder.chunk(delta, with_usage_field=with_usage_field)
                assert got == _expected(kind, builder, choice, with_usage_field=with_usage_field), (text, reason)
                assert json.loads(got.removeprefix(b"data: "))["choices"][0]["finish_reason"] == finish


def test_usage_and_first_chunks_keep_their_shape():
    builder = ResponseBuilder(kind="chat", request_id="ab" * 16, model="m", n=1, logprobs=False)
    first = builder.chunk(Delta(index=0, text="hi", logprobs=[], finish_reason=None), with_usage_field=True)
    choice = {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": None}
    assert first == _expected("chat", builder, choice, with_usage_field=True)
    builder.usage.prompt_tokens, builder.usage.completion_tokens = 3, 2
    usage = json.loads(builder.usage_chunk().removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5 and usage["id"] == builder.id


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("with_usage_field", [False, True], ids=["no-usage-field", "usage-field"])
@pytest.mark.parametrize("echo", [False, True], ids=["no-echo", "echo"])
def test_each_choices_first_chunk_is_openai_shaped_json(kind, with_usage_field, echo):
    """A choice's first chunk: the role for chat, the echoed prompt before a completion's text (written by hand where
    it can be, checked here against json.dumps of OpenAI's chunk)."""
    for text in TEXTS:
        for reason in [None, *FINISH_REASONS]:
            prompts = ['odd "prompt" \u00e9'] * 2 if echo and kind == "completion" else []
            builder = ResponseBuilder(kind=kind, request_id="0f" * 16, model='m "\u00e9"', n=2, logprobs=True,
                                      echo=prompts)  # fmt: skip
            for index in (1, 0):
                delta = Delta(index=index, text=text, logprobs=[], finish_reason=reason, tokens=1)
                finish = FINISH_REASONS.get(reason, "stop") if reason else None
                if kind == "chat":
                    content = {"delta": {"role": "assistant", "content": text}}
                else:
                    content = {"text": (prompts[index] if prompts else "") + text}
                choice = {"index": index, **content, "logprobs": None, "finish_reason": finish}
                got = builder.chunk(delta, with_usage_field=with_usage_field)
                assert got == _expected(kind, builder, choice, with_usage_field=with_usage_field), (text, reason)
                after = builder.chunk(Delta(index=index, text="x", logprobs=[], finish_reason=None, tokens=1),
                                      with_usage_field=with_usage_field)  # fmt: skip
                assert b'"role"' not in after and b"prompt" not in after  # the first is only the first
