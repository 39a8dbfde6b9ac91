"""POST /v1/completions (OpenAI's legacy completions) as gateway.openai_request.parse_completion takes it and
gateway.openai_response answers it, and the models listing."""

from quilt.openai_schema.generation import CHUNK_USAGE, FINISH_REASON, common_properties
from quilt.openai_schema.shapes import (
    UNIX_TIME,
    array,
    boolean,
    const,
    integer,
    nullable,
    number,
    obj,
    ref,
    text,
)

TOKEN_IDS = array(integer(minimum=0, maximum=2**31 - 1), minItems=1, description="Token ids of the base model.")
PROMPT = {
    "oneOf": [
        text(),
        array(text(), minItems=1, maxItems=32),
        TOKEN_IDS,
        array(TOKEN_IDS, minItems=1, maxItems=32),
    ],
    "description": "One prompt (a string or a list of token ids) or a batch of up to 32 (a list of strings or a list "
                   "of token-id lists). A batch's choices are numbered prompt by prompt: prompt i's choices have the "
                   "indexes i*n .. i*n+n-1. A batch times `n` may hold at most 64 choices.",
}  # fmt: skip
REQUEST = obj({
    **common_properties(n_description="Choices to generate for each prompt.", prompt={"prompt": PROMPT}),
    "echo": nullable(boolean("Start each choice's text with its prompt.", default=False)),
    "logprobs": nullable(integer("Return each token's log probability and this many likeliest alternatives (0: "
                                 "none). With `echo`, the prompt's tokens too (the first has a null logprob).",
                                 minimum=0, maximum=5)),
    "best_of": nullable(integer("Only 1 or `n` (the same as leaving it out); anything else is "
                                "`unsupported_parameter`.", minimum=1, maximum=16)),
}, ("model", "prompt"), closed=True, description="`max_tokens` defaults to 16 here. `suffix` is refused "
                                                 "(`unsupported_parameter`); any other unknown field is a 400.")
REQUEST["example"] = {"model": "quilt-demo", "prompt": "the cat sees", "max_tokens": 16, "temperature": 0}

LOGPROBS = obj({
    "tokens": array(text(), description="Each token's text, or `bytes:\\xNN...` for part of a UTF-8 character."),
    "token_logprobs": array(nullable(number())),
    "top_logprobs": array(nullable({"type": "object", "additionalProperties": number(),
                                    "description": "Token to log probability, likeliest first."})),
    "text_offset": array(integer(minimum=0), description="Where each token starts in the choice's `text`."),
}, ("tokens", "token_logprobs", "top_logprobs", "text_offset"))


def _completion(*, streamed: bool) -> dict:
    reason = nullable(FINISH_REASON) if streamed else FINISH_REASON
    choice = obj({
        "index": integer(minimum=0),
        "text": text("The next piece of the text." if streamed else "The generated text (after the prompt, with "
                                                                    "`echo`)."),
        "logprobs": nullable(ref("CompletionLogprobs")),
        "finish_reason": reason,
    }, ("index", "text", "logprobs", "finish_reason"))  # fmt: skip
    usage = CHUNK_USAGE if streamed else ref("CompletionUsage")
    required = ("id", "object", "created", "model", "system_fingerprint", "choices", *(() if streamed else ("usage",)))
    return obj({
        "id": text("`cmpl-` followed by the request id.", pattern="^cmpl-"),
        "object": const("text_completion"),
        "created": UNIX_TIME,
        "model": text(),
        "system_fingerprint": nullable(text("Always null.")),
        "choices": array(choice, **({"description": "Empty in the usage chunk."} if streamed else {"minItems": 1})),
        "usage": usage,
    }, required, description="One `data:` event of a streamed completion." if streamed else "")


MODEL = obj({
    "id": text("The name to pass as `model`: a base model, an adapter, or `adapter@version`."),
    "object": const("model"),
    "created": UNIX_TIME,
    "owned_by": text("`quilt` for a base model, the tenant's slug for an adapter."),
    "parent": text("An adapter's base model."),
    "version": integer("An adapter's version: the promoted one, or the pinned one.", minimum=1),
}, ("id", "object", "created", "owned_by"))
MODEL_LIST = obj({"object": const("list"), "data": array(ref("Model"))}, ("object", "data"),
                 description="The base models and the tenant's adapters that this key may use.")

SCHEMAS = {
    "CompletionRequest": REQUEST, "TextCompletion": _completion(streamed=False),
    "TextCompletionChunk": _completion(streamed=True), "CompletionLogprobs": LOGPROBS, "Model": MODEL,
    "ModelList": MODEL_LIST,
}  # fmt: skip
