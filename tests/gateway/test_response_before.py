"""The stream's cheaper chunk writing gives the bytes the code before it gave (issue 37, item 23), for every kind of
delta in every order: text or none, each finish reason, log-probabilities, tool calls, a choice's first or a later
one, with and without an echo and the usage field. The code before is kept below as it was, as the oracle."""

import itertools
import random

import pytest

from gateway.openai_response import (
    FINISH_REASONS,
    Choice,
    Delta,
    ResponseBuilder,
    _chat_logprobs,
    _completion_logprobs,
)


class BuilderBefore(ResponseBuilder):
    """ResponseBuilder with `chunk` and its choices as they were (main at 0c41398)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.choices = [Choice(index=i) for i in range(kwargs["n"])]

    def chunk(self, delta: Delta, *, with_usage_field: bool) -> bytes | None:
        finish = FINISH_REASONS.get(delta.finish_reason, "stop") if delta.finish_reason else None
        first = delta.index not in self._role_sent
        if not delta.text and not delta.logprobs and finish is None and not first and not delta.tool_calls:
            return None
        if not delta.logprobs and not delta.tool_calls and (not first or self.kind == "chat" or not self.echo):
            text, reason = self._escaped(delta.text), "null" if finish is None else f'"{finish}"'
            if self.kind != "chat":
                content = f'"text":{text}'
            elif first:
                content = f'"delta":{{"role":"assistant","content":{text}}}'
            else:
                content = f'"delta":{{"content":{text}}}'
            if first:
                self._role_sent.add(delta.index)
            return self._chunk_of(f'[{{"index":{delta.index},{content},"logprobs":null,"finish_reason":{reason}}}]',
                                  with_usage_field=with_usage_field)  # fmt: skip
        if self.kind == "chat":
            body: dict = {"content": delta.text} if delta.text or not first else {"content": ""}
            if first:
                body = {"role": "assistant"} | body
                self._role_sent.add(delta.index)
            if delta.tool_calls and not delta.text and not delta.logprobs and not first:
                body = {}
            choice = {
                "index": delta.index, "delta": body,
                "logprobs": _chat_logprobs(delta.logprobs) if self.logprobs and delta.logprobs else None,
                "finish_reason": None if delta.tool_calls else finish,
            }  # fmt: skip
            chunks = [] if body == {} else [self._chunk([choice], with_usage_field=with_usage_field)]
            for call in delta.tool_calls:
                parts = []
                if "name" in call:
                    parts.append({"index": call["index"], "id": call["id"], "type": "function",
                                  "function": {"name": call["name"], "arguments": ""}})  # fmt: skip
                if call.get("arguments"):
                    parts.append({"index": call["index"], "function": {"arguments": call["arguments"]}})
                for part in parts:
                    chunks.append(self._chunk([{"index": delta.index, "delta": {"tool_calls": [part]}, "logprobs": None,
                                                "finish_reason": None}], with_usage_field=with_usage_field))  # fmt: skip
            if delta.tool_calls and finish is not None:
                chunks.append(self._chunk([{"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": finish}],
                                          with_usage_field=with_usage_field))  # fmt: skip
            return b"".join(chunks)
        else:
            self._role_sent.add(delta.index)
            echo = self._echo(delta.index)
            offset = 0 if first else len(echo) + len(self.choices[delta.index].text) - len(delta.text)
            choice = {
                "index": delta.index, "text": echo + delta.text if first else delta.text,
                "logprobs": _completion_logprobs(delta.logprobs, offset) if self.logprobs and delta.logprobs else None,
                "finish_reason": finish,
            }  # fmt: skip
        return self._chunk([choice], with_usage_field=with_usage_field)

    @staticmethod
    def _escaped(text: str) -> str:
        from json.encoder import encode_basestring_ascii

        return encode_basestring_ascii(text)


TEXTS = ["", " w", 'q"\\\n', "caf\u00e9 \U0001f600", "\ud83d"]
REASONS = [None, *FINISH_REASONS, "new-reason"]
LOGPROBS = [[], [{"token": "a", "bytes": [97], "whole": True, "logprob": -0.5,
                  "top_logprobs": [{"token": "b", "bytes": [98], "whole": True, "logprob": -1.0}]}]]  # fmt: skip
TOOL_CALLS = [[], [{"index": 0, "id": "c1", "name": "f", "arguments": ""}], [{"index": 0, "arguments": '{"x"'}]]


def deltas(rng: random.Random, n: int):
    for _ in range(rng.randint(1, 8)):
        yield Delta(index=rng.randrange(n), text=rng.choice(TEXTS), logprobs=rng.choice(LOGPROBS),
                    finish_reason=rng.choice(REASONS), tokens=rng.randint(0, 2), tool_calls=rng.choice(TOOL_CALLS))  # fmt: skip


@pytest.mark.parametrize("kind, echo, logprobs, with_usage_field",
                         list(itertools.product(["chat", "completion"], [False, True], [False, True], [False, True])))  # fmt: skip
def test_the_same_chunks_as_before(kind, echo, logprobs, with_usage_field):
    rng = random.Random(f"{kind}{echo}{logprobs}{with_usage_field}")
    for _ in range(300):
        n = rng.randint(1, 3)
        prompts = [f'prompt "{i}" \u00e9' for i in range(n)] if echo and kind == "completion" else []
        fields = dict(kind=kind, request_id="0f" * 16, model='m "\u00e9"', n=n, logprobs=logprobs, echo=prompts)
        now, before = ResponseBuilder(**fields), BuilderBefore(**fields)
        before.created = now.created
        before._opening = now._opening
        for delta in deltas(rng, n):
            now.apply(delta)
            before.apply(delta)
            assert now.chunk(delta, with_usage_field=with_usage_field) == \
                before.chunk(delta, with_usage_field=with_usage_field), delta  # fmt: skip
            assert now._role_sent == before._role_sent
        assert now.choices == before.choices
        assert now.usage_chunk() == before.usage_chunk()


@pytest.mark.parametrize("kind, echo, logprobs, with_usage_field",
                         list(itertools.product(["chat", "completion"], [False, True], [False, True], [False, True])))  # fmt: skip
def test_a_text_delta_and_the_finishes_without_deltas_as_before(kind, echo, logprobs, with_usage_field):
    """`text_chunk` (the engine's common delta) and `finish`/`finish_chunks` (a final event's) give the chunks and
    the response that `apply` then `chunk` of their Deltas gave."""
    rng = random.Random(f"text{kind}{echo}{logprobs}{with_usage_field}")
    for _ in range(300):
        n = rng.randint(1, 3)
        prompts = [f'prompt "{i}" \u00e9' for i in range(n)] if echo and kind == "completion" else []
        fields = dict(kind=kind, request_id="0f" * 16, model='m "\u00e9"', n=n, logprobs=logprobs, echo=prompts)
        now, before = ResponseBuilder(**fields), BuilderBefore(**fields)
        before.created = now.created
        before._opening = now._opening
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.75:
                index, text, tokens = rng.randrange(n), rng.choice(TEXTS), rng.randint(0, 2)
                delta = Delta(index=index, text=text, logprobs=[], finish_reason=None, tokens=tokens)
                before.apply(delta)
                assert now.text_chunk(index, text, tokens, with_usage_field) == \
                    before.chunk(delta, with_usage_field=with_usage_field), delta  # fmt: skip
            else:
                finishes = [(rng.randrange(n), rng.choice(REASONS[1:])) for _ in range(rng.randint(0, n))]
                deltas = [Delta(index=i, text="", logprobs=[], finish_reason=reason) for i, reason in finishes]
                for delta in deltas:
                    before.apply(delta)
                now.finish(finishes)
                assert now.finish_chunks(finishes, with_usage_field) == \
                    [before.chunk(delta, with_usage_field=with_usage_field) for delta in deltas]  # fmt: skip
            assert now.choices == before.choices and now._role_sent == before._role_sent
