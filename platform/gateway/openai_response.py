"""OpenAI response objects and stream chunks, built from the engine's events."""

import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop", "error": "stop"}
_REASON_JSON = {None: "null"} | {reason: f'"{reason}"' for reason in FINISH_REASONS.values()}  # as JSON writes them
# The common chunks' choices, as `chunk` writes them after the response's opening, by kind (index, text or finish
# reason, `_ENDING` by "with the usage field"): a choice's first chunk (a chat's with the role), a later one
_TEXT_FIRST = {"completion": '[{"index":%s,"text":%s,"logprobs":null,"finish_reason":null}]%s',
               "chat": '[{"index":%s,"delta":{"role":"assistant","content":%s},"logprobs":null,"finish_reason":null}]%s'}
_TEXT_LATER = _TEXT_FIRST | {"chat": '[{"index":%s,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]%s'}
_FINISH_FIRST = {"completion": '[{"index":%s,"text":"","logprobs":null,"finish_reason":%s}]%s',
                 "chat": '[{"index":%s,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":%s}]%s'}
_FINISH_LATER = _FINISH_FIRST | {"chat": '[{"index":%s,"delta":{"content":""},"logprobs":null,"finish_reason":%s}]%s'}
_ENDING = ("}\n\n", ',"usage":null}\n\n')


@dataclass
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # [{"token", "logprob", "top_logprobs": [{token, logprob}]}]
    tokens: int = 0
    tool_calls: list[dict] = field(default_factory=list)  # the engine's: {"index", "id", "name", "arguments"}
    prompt_tokens: int = 0  # its prompt's, from its first delta with tokens (for continuous usage)


@dataclass
class Usage:
    """OpenAI's usage, and, where the engine speculated for the request, its speculative-decoding counts
    (docs/speculative.md), which a client benchmarking latency can read; billing counts tokens the same however
    they were made. Without speculation the usage is OpenAI's shape alone."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    sampling_steps: int = 0

    def body(self) -> dict:
        body = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
        if self.spec_proposed_tokens:
            body |= {"spec_proposed_tokens": self.spec_proposed_tokens, "spec_accepted_tokens": self.spec_accepted_tokens,
                     "sampling_steps": self.sampling_steps}  # fmt: skip
        return body


@dataclass
class Delta:
    """What one engine event adds to one choice."""

    index: int
    text: str
    logprobs: list[dict]
    finish_reason: str | None
    tokens: int = 0  # new tokens in this event
    tool_calls: list[dict] = field(default_factory=list)  # a call's start {"index", "id", "name", "arguments"},
    # or a fragment of its arguments {"index", "arguments"} (engine/tool_calls.py)
    prompt_tokens: int = 0  # the choice's prompt's tokens, on its first delta with tokens (0: not in this one)


def _chat_logprobs(entries: list[dict]) -> dict:
    def item(entry: dict) -> dict:
        return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}

    return {
        "content": [item(e) | {"top_logprobs": [item(t) for t in e.get("top_logprobs") or []]} for e in entries],
        "refusal": None,
    }


def _completion_token(entry: dict) -> str:
    """The legacy API's name for a token: its text, or `bytes:\\xNN...` for part of a UTF-8 character."""
    return entry["token"] if entry["whole"] else "bytes:" + entry["token"]


def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The legacy shape; an echoed prompt's first token has a null logprob and null alternatives, as OpenAI's."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(_completion_token(entry))
        logprobs.append(entry["logprob"])
        top = entry.get("top_logprobs")
        tops.append(None if top is None else {_completion_token(t): t["logprob"] for t in top})
        offsets.append(offset)
        offset += len(entry["token"]) if entry["whole"] else 0
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


class ResponseBuilder:
    """Builds the chat.completion / text_completion object, or its stream chunks, for one request.

    With `continuous_usage` (vLLM's stream_options.continuous_usage_stats), every chunk of a choice carries its running
    usage, {"prompt_tokens", "completion_tokens", "total_tokens"}: its prompt's tokens and the tokens it has made so far,
    as vLLM counts them per choice; the usage chunk at the end has the request's, as without it."""

    def __init__(self, *, kind: str, request_id: str, model: str, n: int, logprobs: bool, echo: list[str] = (),
                 continuous_usage: bool = False):  # fmt: skip
        self.kind = kind
        self.continuous_usage = continuous_usage
        self.echo = list(echo)  # completions: each choice's prompt, before its text (or none)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.choices = list(map(Choice, range(n)))  # Choice(index=i) for each
        self.usage = Usage()
        self._role_sent: set[int] = set()
        # Every chunk of this response opens alike: encoded once, each chunk adds only its choices (and usage).
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._opening = (  # as `_compact` would write {"id":..., "choices": ...} up to the choices
            f'data: {{"id":{encode_basestring_ascii(self.id)},"object":"{obj}","created":{self.created},'
            f'"model":{encode_basestring_ascii(self.model)},"system_fingerprint":null,"choices":'
        ).encode()

    def apply(self, delta: Delta) -> None:
        choice = self.choices[delta.index]
        choice.text += delta.text
        choice.logprobs += delta.logprobs
        choice.tokens += delta.tokens
        if delta.prompt_tokens:
            choice.prompt_tokens = delta.prompt_tokens
        for part in delta.tool_calls:  # a call's start, then fragments of its arguments
            if part["index"] < len(choice.tool_calls):
                choice.tool_calls[part["index"]]["arguments"] += part.get("arguments", "")
            else:
                choice.tool_calls.append(dict(part))
        if delta.finish_reason is not None:
            choice.finish_reason = FINISH_REASONS.get(delta.finish_reason, "stop")

    # whole responses

    def body(self) -> dict:
        if self.kind == "chat":
            choices = [
                {
                    "index": c.index,
                    "message": _message(c),
                    "logprobs": _chat_logprobs(c.logprobs) if self.logprobs else None,
                    "finish_reason": c.finish_reason or "stop",
                }
                for c in self.choices
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": c.index,
                    "text": self._echo(c.index) + c.text,
                    "logprobs": _completion_logprobs(c.logprobs, 0) if self.logprobs else None,
                    "finish_reason": c.finish_reason or "stop",
                }
                for c in self.choices
            ]
            obj = "text_completion"
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "system_fingerprint": None, "choices": choices, "usage": self.usage.body(),
        }  # fmt: skip

    # stream chunks

    def _chunk(self, choices: list[dict], *, with_usage_field: bool, usage: dict | None = None) -> bytes:
        """`data: {"id",...,"choices":[...](,"usage":...)}`, compact, as json.dumps would write the whole object."""
        if usage is None and self.continuous_usage and choices:
            usage = self.running_usage(choices[0]["index"])
        return self._chunk_of(_compact(choices), with_usage_field=with_usage_field, usage=usage)

    def running_usage(self, index: int) -> dict:
        """A choice's usage so far (continuous usage): its prompt's tokens (the request's, once the final event
        has them, for a choice that had no delta with tokens) and the tokens it has made."""
        choice = self.choices[index]
        prompt = choice.prompt_tokens or self.usage.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": choice.tokens, "total_tokens": prompt + choice.tokens}

    def _ending(self, index: int, with_usage_field: bool) -> str:
        """What closes a chunk of choice `index`: its running usage with continuous usage, else `_ENDING`'s."""
        if self.continuous_usage and with_usage_field:
            return ',"usage":' + _compact(self.running_usage(index)) + "}\n\n"
        return _ENDING[with_usage_field]

    def _chunk_of(self, choices: str, *, with_usage_field: bool, usage: dict | None = None) -> bytes:
        ending = (',"usage":' + _compact(usage) + "}\n\n") if with_usage_field else "}\n\n"
        return self._opening + (choices + ending).encode()

    def chunk(self, delta: Delta, *, with_usage_field: bool) -> bytes | None:
        index, text = delta.index, delta.text
        finish = FINISH_REASONS.get(delta.finish_reason, "stop") if delta.finish_reason else None
        first = index not in self._role_sent
        if not delta.logprobs and not delta.tool_calls and (not first or self.kind == "chat" or not self.echo):
            if not text and finish is None and not first:
                return None  # nothing to send
            # the common chunk (a text delta, a choice's first with its role or without an echo), without a dict
            escaped = encode_basestring_ascii(text)
            if self.kind != "chat":
                content = f'"text":{escaped}'
            elif first:
                content = f'"delta":{{"role":"assistant","content":{escaped}}}'
            else:
                content = f'"delta":{{"content":{escaped}}}'
            if first:
                self._role_sent.add(index)
            ending = self._ending(index, with_usage_field)
            return self._opening + (f'[{{"index":{index},{content},"logprobs":null,"finish_reason":'
                                    f'{_REASON_JSON[finish]}}}]{ending}').encode()  # fmt: skip
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
            for call in delta.tool_calls:  # as OpenAI streams a call: its id and name, then its arguments
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

    def text_chunk(self, index: int, text: str, tokens: int, with_usage_field: bool) -> bytes | None:
        """`apply` then `chunk` of the engine's common delta, text and tokens alone (no log-probabilities, tool calls
        or finish reason), without making its Delta. Not for continuous usage, whose chunks need the delta's
        prompt tokens: those take `apply` and `chunk`."""
        choice = self.choices[index]
        choice.text += text
        choice.tokens += tokens
        if index in self._role_sent:
            if not text:
                return None  # nothing to send
            choices = _TEXT_LATER[self.kind]
        elif self.kind == "chat" or not self.echo:
            self._role_sent.add(index)
            choices = _TEXT_FIRST[self.kind]
        else:  # a completion's first chunk, after its echoed prompt
            return self.chunk(Delta(index, text, [], None, tokens), with_usage_field=with_usage_field)
        return self._opening + (choices % (index, encode_basestring_ascii(text), _ENDING[with_usage_field])).encode()

    def finish(self, finishes: list[tuple]) -> None:
        """`apply` of the choices' finishes, (index, the engine's reason) each: Deltas of them alone."""
        for index, reason in finishes:
            self.choices[index].finish_reason = FINISH_REASONS.get(reason, "stop")

    def finish_chunks(self, finishes: list[tuple], with_usage_field: bool) -> list[bytes]:
        """`chunk` of the choices' finishes, (index, the engine's reason, not empty) each: Deltas of them alone."""
        chunks = []
        for index, reason in finishes:
            if index in self._role_sent:
                choices = _FINISH_LATER[self.kind]
            elif self.kind == "chat" or not self.echo:
                self._role_sent.add(index)
                choices = _FINISH_FIRST[self.kind]
            else:  # a completion's first chunk, after its echoed prompt
                chunks.append(self.chunk(Delta(index, "", [], reason), with_usage_field=with_usage_field))
                continue
            finish = _REASON_JSON[FINISH_REASONS.get(reason, "stop")]
            chunks.append(self._opening + (choices % (index, finish, self._ending(index, with_usage_field))).encode())
        return chunks

    def _echo(self, index: int) -> str:
        return self.echo[index] if self.echo else ""

    def usage_chunk(self) -> bytes:
        return self._chunk([], with_usage_field=True, usage=self.usage.body())


def _message(choice: Choice) -> dict:
    """A chat choice's message: its content (null beside tool calls and nothing else), and its tool calls."""
    content = choice.text if choice.text or not choice.tool_calls else None
    message = {"role": "assistant", "content": content, "refusal": None}
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in choice.tool_calls
        ]
    return message


# Compact JSON with ASCII escapes, as json.dumps(value, separators=(",", ":")) writes it and as the chunks' text is
# written (`encode_basestring_ascii`): one encoder made once rather than one per json.dumps call.
_compact = json.JSONEncoder(separators=(",", ":")).encode


DONE = b"data: [DONE]\n\n"


def error_event(*, message: str, code: str, type: str = "server_error") -> bytes:  # noqa: A002
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
