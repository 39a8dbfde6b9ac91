"""The /v1 API's OpenAPI description, as the docs serve it, read as JSON Schema validators, so that tests can check
real answers (and the gateway's refusals) against what the docs promise.

jsonschema has no OpenAPI 3.0 dialect; of what 3.0 adds to JSON Schema the description uses only `nullable` and
the boolean `exclusiveMinimum` (and the annotations `discriminator` and `example`), so a 2020-12 validator over the
schemas with `nullable` spelled as "or null" and `exclusiveMinimum` as the bound reads them exactly."""

import functools
import json

import jsonschema


@functools.cache
def document() -> dict:
    """The schema the docs page renders (GET /api/schema/ answers the same generator's output)."""
    from drf_spectacular.generators import SchemaGenerator

    return json.loads(json.dumps(SchemaGenerator().get_schema(request=None, public=True), default=str))


def _json_schema(node):
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {name: _json_schema(value) for name, value in node.items() if name not in ("nullable", "discriminator")}
    if node.get("exclusiveMinimum") is True:  # 3.0's flag on `minimum`; 2020-12's is the bound itself
        converted["exclusiveMinimum"] = converted.pop("minimum")
    if node.get("nullable") is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


@functools.cache
def _root() -> dict:
    return {"components": {"schemas": _json_schema(document()["components"]["schemas"])}}


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    """A validator of an OpenAPI schema object from the document (its references resolve in the document)."""
    root = {**_root(), **_json_schema(schema)}
    jsonschema.Draft202012Validator.check_schema(root)
    return jsonschema.Draft202012Validator(root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def component(name: str) -> jsonschema.Draft202012Validator:
    return validator({"$ref": f"#/components/schemas/{name}"})


def operation(method: str, path: str) -> dict:
    return document()["paths"][path][method.lower()]


def response(method: str, path: str, status: int) -> dict:
    """What the docs say an operation answers with this status: a KeyError if they don't document it."""
    return operation(method, path)["responses"][str(status)]


def check_answer(method: str, path: str, status: int, body, *, content_type: str = "application/json",
                 headers=None) -> None:
    """The answer's body matches its documented schema, and each x-ratelimit-*, Retry-After and x-request-id header
    it carries is one the docs list for that status."""
    documented = response(method, path, status)
    validator(documented["content"][content_type]["schema"]).validate(body)
    if headers is not None:
        listed = {name.lower() for name in documented.get("headers", {})}
        sent = {name.lower() for name in headers if name.lower().startswith(("x-ratelimit-", "retry-after",
                                                                              "x-request-id"))}  # fmt: skip
        assert sent <= listed, (method, path, status, sorted(sent - listed))


def sse_events(lines) -> list:
    """The JSON of each event of a stream as the docs frame it: `data: <JSON>` lines, each followed by a blank one,
    the last one `data: [DONE]`."""
    lines = list(lines)
    assert lines[-2:] in (["data: [DONE]", ""], ["data: [DONE]"]), lines[-3:]
    events = lines[:-2] if lines[-1] == "" else lines[:-1]
    assert len(events) % 2 == 0 and all(line == "" for line in events[1::2]), events
    assert all(line.startswith("data: ") for line in events[::2]), events
    return [json.loads(line.removeprefix("data: ")) for line in events[::2]]
