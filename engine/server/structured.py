"""What a generate request's response_format, tools and tool_choice mean for this model: the tools its chat
template sees, the grammar that constrains its output, and whether its text is parsed for tool calls.

    tool_choice "required" / a named function   grammar: one call (several with parallel_tool_calls)
    tool_choice "auto"                          free text or calls, parsed; with a JSON response_format the
                                                grammar allows that JSON or calls
    tool_choice "none" / no tools               response_format's grammar, if any; nothing parsed
"""

from collections.abc import Callable
from dataclasses import dataclass

from engine.grammar import GrammarSpec
from engine.server.protocol import BadRequest, GenerateRequest
from engine.tool_calls import ToolCallFormat, inline_json


@dataclass(frozen=True)
class Structure:
    template_tools: list[dict] | None  # the `tools` variable of the chat template
    grammars: tuple[GrammarSpec, ...]  # compiled in order; the last one constrains the output (the others are
    # its parts, compiled first so that an error names the parameter at fault)
    tool_format: ToolCallFormat | None  # parse the output for calls in this convention

    @property
    def grammar(self) -> GrammarSpec | None:
        return self.grammars[-1] if self.grammars else None


def plan(request: GenerateRequest, *, tool_format: ToolCallFormat | None,
         special_id: Callable[[str], int | None]) -> Structure:
    answer = _answer_schema(request.response_format)
    answer_spec = (GrammarSpec.json_schema(answer, param=_format_param(request.response_format)),) if answer else ()
    choice, tools = request.tool_choice, request.tools
    if tools is None or choice == "none":
        return Structure(template_tools=None, grammars=answer_spec, tool_format=None)
    if any(prompt.messages is None for prompt in request.prompts):
        raise BadRequest("tools need chat messages", param="tools")
    if tool_format is None:
        raise BadRequest("this model's chat template has no tool-calling convention Quilt knows (Hermes "
                         "<tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS])", param="tools")
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    calls = tool_format.grammar(functions, parallel=request.parallel_tool_calls, special_id=special_id)
    if choice == "auto" and answer is None:
        return Structure(template_tools=tools, grammars=(), tool_format=tool_format)
    start = "start: calls" if choice != "auto" else "start: calls | answer\n" + inline_json("answer", answer)
    grammar = GrammarSpec.lark(f"{start}\n{calls}", param="tools")
    return Structure(template_tools=tools, grammars=(*answer_spec, grammar), tool_format=tool_format)


def _answer_schema(response_format: dict | None) -> dict | None:
    if response_format is None:
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def _format_param(response_format: dict) -> str:
    return "response_format.json_schema.schema" if response_format["type"] == "json_schema" else "response_format"
