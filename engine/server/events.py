"""The events of /v1/generate (engine.contract.events): deltas while a request runs, one final event at its end,
made from the engine's outputs."""

from engine.contract.events import Choice, Delta, Final, FinalUsage, KVPull, Logprob
from engine.outputs import Logprob as EngineLogprob
from engine.outputs import RequestOutput
from engine.server.engine_loop import RequestEnd, RequestHandle
from engine.tool_calls import ToolCallStream


def logprob_of(entry: EngineLogprob) -> Logprob:
    return Logprob(token_id=entry.token_id, logprob=entry.logprob, top=dict(entry.top))


def prompt_logprobs_of(output: RequestOutput) -> list[Logprob]:
    entries = output.prompt_logprobs or []
    return [Logprob(token_id=output.prompt_token_ids[0], logprob=None)] + [logprob_of(e) for e in entries[1:]]


def delta_event(handle: RequestHandle, output: RequestOutput, sent: dict[int, int]) -> Delta | None:
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
    event = Delta(request_id=handle.request_id, index=output.index, text=text, token_ids=list(output.new_token_ids))
    if calls:
        event.tool_calls = calls
    if handle.request.sampling.logprobs is not None and output.logprobs is not None and output.new_token_ids:
        event.logprobs = [logprob_of(e) for e in output.logprobs[-len(output.new_token_ids):]]
    first_tokens = output.new_token_ids and len(output.token_ids) == len(output.new_token_ids)
    if first_tokens:
        event.prompt_tokens = len(output.prompt_token_ids)
    if handle.request.sampling.prompt_logprobs is not None and first_tokens:
        event.prompt_logprobs = prompt_logprobs_of(output)
    return event


def final_event(handle: RequestHandle, end: RequestEnd) -> Final:
    choices = []
    for output in end.outputs:
        choice = Choice(index=output.index, text=output.text, token_ids=list(output.token_ids),
                        finish_reason=output.finish_reason, error=output.error, error_type=output.error_type)
        if handle.tool_format is not None:
            stream = handle.tool_streams.get(output.index) or ToolCallStream(handle.tool_format)
            stream.push(output.text, final=True)
            choice.text = handle.tool_format.parse(output.text, final=True).content
            choice.tool_calls = [call.as_json(i) for i, call in enumerate(stream.calls)]
            if stream.calls and output.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
        if handle.request.sampling.logprobs is not None and output.logprobs is not None:
            choice.logprobs = [logprob_of(e) for e in output.logprobs]
        if handle.request.sampling.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_of(output)
        choices.append(choice)
    usage = end.usage
    first = choices[0]
    errors = [c for c in choices if c.error]
    pull = handle.kv_pull  # a decode hop's (docs/kv-tiers.md)
    return Final(
        request_id=handle.request_id,
        finish_reason=first.finish_reason if end.finish_reason == "stop" else end.finish_reason,
        text=first.text,
        token_ids=first.token_ids,
        error=errors[0].error if errors else None,
        error_type=errors[0].error_type if errors else None,
        choices=choices,
        usage=FinalUsage(
            prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens, gpu_ms=usage.gpu_ms, queue_ms=usage.queue_ms,
            ttft_ms=usage.ttft_ms, e2e_ms=end.e2e_ms, spec_proposed_tokens=usage.spec_proposed_tokens,
            spec_accepted_tokens=usage.spec_accepted_tokens, sampling_steps=usage.sampling_steps,
            kv_transfer=None if pull is None else KVPull(lease_id=pull.lease_id, blocks_pulled=pull.blocks_pulled,
                                                         recomputed=pull.recomputed),
        ),
    )  # fmt: skip
