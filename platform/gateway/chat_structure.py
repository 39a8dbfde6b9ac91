"""A chat request's structure: what the engine constrains its output to and parses out of it (response_format,
tools, tool_choice, parallel_tool_calls), validated as OpenAI validates them."""

import re

from gateway.errors import invalid

MAX_TOOLS = 128  # OpenAI's bound
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a function's or a schema's name, as OpenAI allows them


def _response_format(value) -> dict | None:
    """OpenAI's response_format, its shape checked; the schema itself is checked when the engine compiles it."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                      "'json_schema', 'json_schema': {...}}.", param="response_format")  # fmt: skip
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("'response_format.json_schema' must be an object with a name and a schema.",
                      param="response_format.json_schema")  # fmt: skip
    if not isinstance(spec.get("name"), str) or not NAME.match(spec["name"]):
        raise invalid("'response_format.json_schema.name' must be 1 to 64 letters, digits, underscores or dashes.",
                      param="response_format.json_schema.name")  # fmt: skip
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("'response_format.json_schema.schema' must be a JSON schema object.",
                      param="response_format.json_schema.schema")  # fmt: skip
    if not isinstance(spec.get("strict", False), bool) and spec.get("strict") is not None:
        raise invalid("'response_format.json_schema.strict' must be a boolean.", param="response_format.json_schema.strict")
    return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": schema}}


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise invalid("Invalid 'tools': expected a non-empty array of tools.", param="tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"Invalid 'tools': at most {MAX_TOOLS} tools, not {len(value)}.", param="tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"Invalid '{param}': only {{'type': 'function', 'function': {{...}}}} tools are supported.",
                          param=param)  # fmt: skip
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid(f"Invalid '{param}.function.name': a tool needs a name of 1 to 64 letters, digits, "
                          f"underscores or dashes.", param=f"{param}.function.name")  # fmt: skip
        if name in names:
            raise invalid(f"Invalid '{param}.function.name': '{name}' is given twice.", param=f"{param}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"Invalid '{param}.function.parameters': must be a JSON schema object.",
                          param=f"{param}.function.parameters")  # fmt: skip
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"Invalid '{param}.function.description': must be a string.",
                          param=f"{param}.function.description")  # fmt: skip
        kept = {"name": name} | ({"description": description} if description else {}) \
            | ({"parameters": parameters} if parameters is not None else {})  # fmt: skip
        tools.append({"type": "function", "function": kept})
    return tools


def _tool_choice(value, tools: list[dict] | None):
    if value is None:
        return None
    if tools is None:
        raise invalid("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}.", param="tool_choice")  # fmt: skip
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"'tool_choice' names the function '{name}', which is not in 'tools'.", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    if value not in ("none", "auto", "required"):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}.", param="tool_choice")  # fmt: skip
    return value


def structure(body: dict) -> dict:
    """What the engine constrains and parses: response_format, tools, tool_choice, parallel_tool_calls."""
    tools = _tools(body.get("tools"))
    structure = {}
    if (format_ := _response_format(body.get("response_format"))) is not None:
        structure["response_format"] = format_
    if tools is not None:
        structure["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"), tools)) is not None:
        structure["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
        if tools is None:
            raise invalid("'parallel_tool_calls' is only allowed when 'tools' are specified.",
                          param="parallel_tool_calls")  # fmt: skip
        structure["parallel_tool_calls"] = parallel
    return structure
