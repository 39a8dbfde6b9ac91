"""An engine's refusal of a request (a 4xx) as the client's 400: its reason without the engine host's paths, and its
code and field in the client's terms."""

import re

from gateway.engine_client import EngineRejected
from gateway.errors import ApiError, invalid
from gateway.openai_request import GenerationRequest

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")


def without_paths(message: str) -> str:
    """An engine's refusal as the client may read it: no filesystem paths of the engine's host."""
    return _PATH.sub("<path>", message)


STRUCTURE_PARAMS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")  # named alike on both sides


def engine_refusal(rejected: EngineRejected, generation: GenerationRequest) -> ApiError:
    """An engine's 4xx as the client's 400: its reason, and its code and field in the client's terms."""
    param = rejected.param
    if param in ("prompt", "prompt_token_ids", "messages"):
        param = "messages" if generation.messages is not None else "prompt"
    elif param is not None and param.startswith(STRUCTURE_PARAMS):
        pass  # the client's own name (e.g. "response_format.json_schema.schema", "tools[0].function.parameters")
    elif param is not None:
        param = param.removeprefix("sampling.") if param.startswith("sampling.") else None
    return invalid(without_paths(rejected.message), param=param, code=rejected.code or "engine_rejected")

