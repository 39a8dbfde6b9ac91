"""The JSON events of /v1/generate: deltas while a request runs, one final event at its end.

    {"type": "delta", "request_id", "index", "text", "token_ids", "prompt_tokens"?, "logprobs"?, "prompt_logprobs"?,
     "tool_calls"?}
    {"type": "final", "request_id", "finish_reason", "text", "token_ids", "error", "error_type",
     "choices": [{"index", "text", "token_ids", "finish_reason", "error", "error_type", "logprobs"?,
                  "prompt_logprobs"?, "tool_calls"?}],
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens", "gpu_ms", "queue_ms", "ttft_ms", "e2e_ms",
               "spec_proposed_tokens", "spec_accepted_tokens", "sampling_steps",
               "kv_transfer"?: {"lease_id", "blocks_pulled", "recomputed"} (a decode hop, docs/kv-tiers.md)}}

A completion's first delta with tokens carries `prompt_tokens`, its prompt's token count: a client that shows usage
in every chunk (stream_options.continuous_usage_stats) has it before the final event.

With sampling.prompt_logprobs, a completion's first delta (the one with its first tokens) and its final choice carry
`prompt_logprobs`: one entry per prompt token, the first one's logprob null (nothing precedes it). A batch of prompts
has n completions per prompt, indexed prompt * n + i.

A request whose output is parsed for tool calls (engine/tool_calls.py) has `text` without the calls' markup; a
delta's `tool_calls` holds {"index", "id", "name", "arguments"} when a call starts (its arguments whole if it
completed at once, else "") and {"index", "arguments": fragment} as they grow; the final event has each call whole;
a choice that called tools finishes with "tool_calls".

`text`, `token_ids` and `finish_reason` at the top of the final event are completion 0's. The usage holds the
counts of the request's usage event (speculative decoding's included: docs/speculative.md), streamed or not.
"""

from typing import Any

from engine.contract import EVENT_DELTA, EVENT_FINAL
from engine.outputs import Logprob, RequestOutput
from engine.server.engine_loop import RequestEnd, RequestHandle
from engine.tool_calls import ToolCallStream


def logprob_json(entry: Logprob) -> dict[str, Any]:
    return {"token_id": entry.token_id, "logprob": entry.logprob,
            "top": {str(token): value for token, value in entry.top.items()}}


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, Any]]:
    entries = output.prompt_logprobs or []
    first = {"token_id": output.prompt_token_ids[0], "logprob": None, "top": {}}
    return [first] + [logprob_json(e) for e in entries[1:]]


def delta_event(handle: RequestHandle, output: RequestOutput, sent: dict[int, int]) -> dict[str, Any] | None:
    """What is new in this output since the last delta of its completion (sent: index -> chars sent)."""
    calls = []
    if handle.tool_format is not None:
        stream = handle.tool_streams.setdefault(output.index, ToolCallStream(handle.tool_format))
        text, calls = stream.push(output.text, final=output.finished)
    else:
        already = sent.get(output.index, 0)
        text = output.text[already:]
        sent[output.index] = already + len(text)
    if not text and not output.new_token_ids and not calls:
        return None
    event = {"type": EVENT_DELTA, "request_id": handle.request_id, "index": output.index, "text": text,
             "token_ids": list(output.new_token_ids)}
    if calls:
        event["tool_calls"] = calls
    if handle.request.sampling.logprobs is not None and output.logprobs is not None and output.new_token_ids:
        event["logprobs"] = [logprob_json(e) for e in output.logprobs[-len(output.new_token_ids):]]
    first_tokens = output.new_token_ids and len(output.token_ids) == len(output.new_token_ids)
    if first_tokens:
        event["prompt_tokens"] = len(output.prompt_token_ids)
    if handle.request.sampling.prompt_logprobs is not None and first_tokens:
        event["prompt_logprobs"] = prompt_logprobs_json(output)
    return event


def final_event(handle: RequestHandle, end: RequestEnd) -> dict[str, Any]:
    choices = []
    for output in end.outputs:
        choice = {"index": output.index, "text": output.text, "token_ids": list(output.token_ids),
                  "finish_reason": output.finish_reason, "error": output.error, "error_type": output.error_type}
        if handle.tool_format is not None:
            stream = handle.tool_streams.get(output.index) or ToolCallStream(handle.tool_format)
            stream.push(output.text, final=True)
            choice["text"] = handle.tool_format.parse(output.text, final=True).content
            choice["tool_calls"] = [call.as_json(i) for i, call in enumerate(stream.calls)]
            if stream.calls and output.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        if handle.request.sampling.logprobs is not None and output.logprobs is not None:
            choice["logprobs"] = [logprob_json(e) for e in output.logprobs]
        if handle.request.sampling.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(output)
        choices.append(choice)
    usage = end.usage
    first = choices[0]
    finish_reason = first["finish_reason"] if end.finish_reason == "stop" else end.finish_reason
    errors = [c for c in choices if c["error"]]
    usage_json = {
        "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
        "completion_tokens": usage.completion_tokens, "gpu_ms": usage.gpu_ms, "queue_ms": usage.queue_ms,
        "ttft_ms": usage.ttft_ms, "e2e_ms": end.e2e_ms, "spec_proposed_tokens": usage.spec_proposed_tokens,
        "spec_accepted_tokens": usage.spec_accepted_tokens, "sampling_steps": usage.sampling_steps,
    }
    if handle.kv_pull is not None:  # a decode hop (docs/kv-tiers.md)
        usage_json["kv_transfer"] = handle.kv_pull.as_json()
    return {
        "type": EVENT_FINAL,
        "request_id": handle.request_id,
        "finish_reason": finish_reason,
        "text": first["text"],
        "token_ids": first["token_ids"],
        "error": errors[0]["error"] if errors else None,
        "error_type": errors[0]["error_type"] if errors else None,
        "choices": choices,
        "usage": usage_json,
    }
