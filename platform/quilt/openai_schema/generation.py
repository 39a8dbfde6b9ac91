"""What chat and legacy completions share: the request's model and sampling fields (as gateway.openai_request reads
them), the usage object, and how a streamed answer is framed."""

from quilt.openai_schema.shapes import array, boolean, integer, nullable, number, obj, ref, text

MODEL = text("A base model (`GET /v1/models`), one of the tenant's adapters by name (its promoted version: "
             "`support-bot`), or a pinned adapter version (`support-bot@3`). An adapter's answers are billed at its "
             "base model's prices.", minLength=1, maxLength=256)

STREAM_OPTIONS = obj({
    "include_usage": boolean("Send one more chunk before `data: [DONE]` with `choices: []` and the request's "
                             "`usage`; every other chunk then carries `usage: null`."),
    "include_obfuscation": boolean("Accepted for OpenAI compatibility and ignored: the stream is not padded."),
    "continuous_usage_stats": boolean("vLLM extension (aiperf sends it): with `include_usage`, every chunk carries "
                                      "its choice's running usage (CompletionUsageSoFar) instead of `usage: null`; "
                                      "without `include_usage` it changes nothing, as in vLLM."),
}, closed=True, description="Only with `stream: true` (otherwise a 400). Any other key is a 400 that lists these.")

LOGIT_BIAS = {
    "type": "object",
    "description": "Token id (a decimal string, as the base model's tokenizer numbers tokens) to a bias added to "
                   "that token's logit before sampling: -100 bans the token, 100 all but forces it. At most 300 "
                   "entries; an id that is not a decimal number below 2^31 is a 400, and one past the model's "
                   "vocabulary is the engine's 400.",
    "additionalProperties": number(minimum=-100, maximum=100),
    "maxProperties": 300,
    "example": {"1734": -100, "50256": 5},
}

_EXTENSION = "vLLM extension, not OpenAI's (load tools such as guidellm, `vllm bench serve`, aiperf and genai-perf send it). "
EXTENSIONS = {
    "ignore_eos": nullable(boolean(_EXTENSION + "Keep generating past the model's end-of-sequence token, to exactly "
                                   "`max_tokens` unless a `stop` sequence or `stop_token_ids` ends it first.",
                                   default=False)),
    "min_tokens": nullable(integer(_EXTENSION + "The end-of-sequence token and `stop_token_ids` are not sampled "
                                   "before this many tokens. At most `max_tokens` (or the plan's default): more is "
                                   "a 400.", minimum=0, default=0)),
    "top_k": nullable(integer(_EXTENSION + "Sample only among the k likeliest tokens; 0 or -1: all of them.",
                              minimum=-1, maximum=2**31, default=0)),
    "min_p": nullable(number(_EXTENSION + "Drop tokens whose probability is below `min_p` times the likeliest "
                             "one's.", minimum=0, maximum=1, default=0)),
    "repetition_penalty": nullable(number(_EXTENSION + "For each token in the prompt or the output so far, a "
                                          "positive logit is divided by it and a negative one multiplied (as "
                                          "transformers and vLLM); 1 is none, above 1 repeats less. Must be > 0.",
                                          exclusiveMinimum=True, minimum=0, default=1)),
    "stop_token_ids": nullable(array(integer(minimum=0, maximum=2**31 - 1), _EXTENSION + "Token ids that end the "
                                     "answer like a `stop` sequence (the token is kept in the output, as in vLLM); "
                                     "an id past the model's vocabulary is the engine's 400.", maxItems=1024)),
}  # fmt: skip

RUNNING_USAGE = obj({
    "prompt_tokens": integer("The choice's prompt's tokens.", minimum=0),
    "completion_tokens": integer("Tokens the choice has generated so far.", minimum=0),
    "total_tokens": integer("prompt_tokens + completion_tokens.", minimum=0),
}, ("prompt_tokens", "completion_tokens", "total_tokens"), description="A chunk's usage with `stream_options: "
   "{include_usage: true, continuous_usage_stats: true}` (vLLM extension), counted per choice as vLLM counts it; "
   "the usage chunk at the end has the request's CompletionUsage.")  # fmt: skip
CHUNK_USAGE = nullable({"anyOf": [ref("CompletionUsage"), ref("CompletionUsageSoFar")]})

STOP = {
    "oneOf": [text(minLength=1), array(text(minLength=1), maxItems=4)],
    "description": "Up to 4 sequences; generation stops before the first one produced (it is not in the answer, "
                   "and `finish_reason` is `stop`). An empty string is refused.",
}


def common_properties(*, n_description: str, prompt: dict) -> dict:
    """The fields both endpoints take, `prompt` (the endpoint's own input field) after the model. Every optional
    field may be null, which means the same as leaving it out."""
    return {
        "model": MODEL,
        **prompt,
        "stream": nullable(boolean("Answer as server-sent events (`text/event-stream`) instead of one JSON object.",
                                   default=False)),
        "stream_options": nullable(STREAM_OPTIONS),
        "max_tokens": nullable(integer("The most tokens to generate per choice (default: the plan's default for "
                                       "chat, 16 for completions). It and the prompt must fit the model's context; "
                                       "admission holds budget for it.", minimum=1, maximum=2**31)),
        "temperature": nullable(number("0 is greedy (the likeliest token each step).", minimum=0, maximum=2,
                                       default=1)),
        "top_p": nullable(number("Nucleus sampling: the smallest set of tokens whose probability reaches `top_p`; "
                                 "0 keeps only the likeliest token.", minimum=0, maximum=1, default=1)),
        "n": nullable(integer(n_description, minimum=1, maximum=16, default=1)),
        "stop": nullable(STOP),
        "seed": nullable(integer("Seeds the request's sampling, so that a sampled answer can be repeated.",
                                 minimum=-(2**63), maximum=2**63 - 1, format="int64")),
        "presence_penalty": nullable(number("Subtracted from the logit of every token already generated "
                                            "(negative: repeat more).", minimum=-2, maximum=2, default=0)),
        "frequency_penalty": nullable(number("Subtracted from each token's logit once for each time it was "
                                             "generated.", minimum=-2, maximum=2, default=0)),
        "logit_bias": nullable(LOGIT_BIAS),
        "user": nullable(text("Your own id for the end user; kept in the request log.")),
        **EXTENSIONS,
    }  # fmt: skip


USAGE = obj({
    "prompt_tokens": integer(minimum=0),
    "completion_tokens": integer("Generated tokens, over all choices.", minimum=0),
    "total_tokens": integer("prompt_tokens + completion_tokens.", minimum=0),
    "prompt_tokens_details": obj({"cached_tokens": integer("Prompt tokens served from the prefix cache (billed at "
                                                           "the cached-input price).", minimum=0)},
                                 ("cached_tokens",)),
    "completion_tokens_details": obj({"reasoning_tokens": integer("Always 0.", minimum=0)}, ("reasoning_tokens",)),
    "spec_proposed_tokens": integer("Only where the engine decoded speculatively: draft tokens proposed.", minimum=0),
    "spec_accepted_tokens": integer("Only where the engine decoded speculatively: draft tokens accepted.", minimum=0),
    "sampling_steps": integer("Only where the engine decoded speculatively: engine steps taken.", minimum=0),
}, ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"),
    description="What the request is billed for.")  # fmt: skip

FINISH_REASON = text("`stop`: the model ended its answer or produced a `stop` sequence (also for a request cut "
                     "short by the server); `length`: `max_tokens` or the context was reached; `tool_calls`: the "
                     "answer is tool calls.", enum=["stop", "length", "tool_calls"])

SSE_FRAMING = (
    "With `stream: true` the answer is `text/event-stream`: each event is one line `data: <JSON>` followed by a blank "
    "line, the JSON being one chunk (the schema below). Events carry no `event:` or `id:` field. The stream ends "
    "with the line `data: [DONE]`. Every chunk of an answer has the same `id`, `created` and `model`. If the engine "
    "fails after the answer started, the last event is `data: {\"error\": {...}}` (OpenAIStreamError) and no "
    "`[DONE]` follows. Refusals (4xx) and errors before the first byte are plain JSON answers with their status."
)
STREAM_HEADERS = {
    "Cache-Control": {"description": "`no-cache` on a stream.", "schema": text()},
    "X-Accel-Buffering": {"description": "`no` on a stream, so that proxies pass each event at once.",
                          "schema": text()},
}
