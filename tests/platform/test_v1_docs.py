"""The API docs describe /v1 completely enough to write a client from them alone: every operation documents its
answer's body, its request body where it takes one, and each error status with the error body; every schema is
valid and every reference resolves; and the error types the docs name per status are the ones the gateway sends."""

import jsonschema
import pytest

from gateway.errors import ApiError
from quilt.openai_schema import SCHEMAS
from quilt.openai_schema.errors import STATUSES, TYPES
from tests.gateway.v1_schema import component, document, validator

pytestmark = pytest.mark.django_db


def _v1_operations():
    return [(method, path, op) for path, ops in document()["paths"].items() if path.startswith("/v1/")
            for method, op in ops.items()]  # fmt: skip


def test_every_v1_operation_documents_its_bodies_and_errors():
    operations = [(method, path, op) for method, path, op in _v1_operations() if op.get("security") != []]
    assert len(operations) == 15
    for method, path, op in operations:
        answer = op["responses"]["200"]
        assert answer["content"], (method, path)
        for content in answer["content"].values():
            validator(content["schema"])  # a valid schema, its references resolved
        if method == "post" and not path.endswith("/cancel"):
            for content in op["requestBody"]["content"].values():
                validator(content["schema"])
        errors = {status: body for status, body in op["responses"].items() if status[0] in "45"}
        assert {"401", "500"} <= errors.keys(), (method, path)
        for body in errors.values():
            assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/OpenAIError"}
    chat = document()["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "403", "404", "413", "415", "429", "503"} <= chat["responses"].keys()
    assert {"Retry-After", "x-ratelimit-remaining-tokens"} <= chat["responses"]["429"]["headers"].keys()


def test_the_health_check_is_the_one_v1_operation_without_a_key_and_documents_its_503():
    open_operations = [(method, path) for method, path, op in _v1_operations() if op.get("security") == []]
    assert open_operations == [("get", "/v1/health")]
    health = document()["paths"]["/v1/health"]["get"]
    for status in ("200", "503"):
        assert health["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/GatewayHealth"}


def test_the_chat_request_schema_names_every_field_the_gateway_reads():
    from gateway.openai_request import CHAT_FIELDS, COMPLETION_FIELDS, UNSUPPORTED

    documented = document()["components"]["schemas"]
    assert set(documented["ChatCompletionRequest"]["properties"]) == CHAT_FIELDS - UNSUPPORTED.keys()
    assert set(documented["CompletionRequest"]["properties"]) == COMPLETION_FIELDS - UNSUPPORTED.keys()


@pytest.mark.parametrize("status", sorted(STATUSES))
def test_each_documented_status_answers_an_error_type_the_docs_name_for_it(status):
    body = ApiError(int(status), "Refused.").body()
    component("OpenAIError").validate(body)
    assert body["error"]["type"] in TYPES[status]


def test_a_tool_and_a_json_schema_format_are_described_field_by_field():
    request = component("ChatCompletionRequest")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {}}},
            "logit_bias": {"42": -100}, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    request.validate(good)
    for bad in ({"tool_choice": "always"}, {"tools": [{"type": "retrieval"}]},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
                {"logit_bias": {"42": -101}}, {"stream_options": {"include_usage": True, "every": 2}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            request.validate(good | bad)


def test_the_examples_the_docs_show_are_valid():
    examples = {name: schema["example"] for name, schema in document()["components"]["schemas"].items()
                if name in SCHEMAS and "example" in schema}  # fmt: skip
    assert {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "CompletionRequest"} <= examples.keys()
    for name, example in examples.items():
        component(name).validate(example)


def test_the_document_is_valid_openapi_3_0():
    """Checked with the OpenAPI 3.0 meta-schema schemathesis carries (an OpenAPI 3.0 schema object is not JSON
    Schema: `nullable`, no `const`, no type lists), so that every OpenAPI tool reads the /v1 part too."""
    from schemathesis.specs.openapi.definitions import OPENAPI_30

    assert document()["openapi"].startswith("3.0")
    errors = [f"{list(error.absolute_path)}: {error.message}"
              for error in jsonschema.Draft4Validator(OPENAPI_30).iter_errors(document())]  # fmt: skip
    assert not errors, errors[:5]


USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# What the gateway's own parser takes or refuses (the gateway test drives the same through the HTTP server).
CHAT_CASES = [
    ({}, True), ({"temperature": True}, False), ({"n": 2.5}, False), ({"top_p": 1.5}, False),
    ({"max_tokens": 0}, False), ({"seed": 2**64}, False), ({"stop": [1]}, False), ({"stop": []}, True),
    ({"messages": "hi"}, False), ({"messages": ["hi"]}, False), ({"messages": [{"role": "user", "content": 5}]}, False),
    ({"messages": [{"role": "function", "content": "x"}]}, False), ({"tools": TOOL}, False), ({"tools": []}, False),
    ({"tools": [{"type": "retrieval"}]}, False), ({"tools": [{"type": "function", "function": {"name": "f",
                                                                                               "parameters": "x"}}]}, False),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, False), ({"tools": [TOOL], "tool_choice": "none"}, True),
    ({"tools": [TOOL] * 129}, False), ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": []}}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}}, False),
    ({"response_format": {"type": "text", "extra": 1}}, False), ({"modalities": ["audio"]}, False),
    ({"modalities": ["text"]}, True), ({"metadata": []}, False), ({"logprobs": "yes"}, False), ({"user": 5}, False),
    ({"logit_bias": {"7": "x"}}, False), ({"logit_bias": {str(i): 1 for i in range(301)}}, False),
    ({"stream": "yes"}, False), ({"max_completion_tokens": 3, "max_tokens": None}, True),
]  # fmt: skip
COMPLETION_CASES = [
    ({}, True), ({"prompt": 5}, False), ({"prompt": [[5], "x"]}, False), ({"prompt": [2**31]}, False),
    ({"prompt": [True]}, False), ({"echo": "yes"}, False), ({"logprobs": True}, False), ({"logprobs": 0}, True),
    ({"n": 3, "best_of": 3}, True), ({"messages": [USER]}, False),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "change", "taken"), [
    *[pytest.param("chat", change, taken, id=f"chat-{i}") for i, (change, taken) in enumerate(CHAT_CASES)],
    *[pytest.param("completion", change, taken, id=f"completion-{i}") for i, (change, taken) in
      enumerate(COMPLETION_CASES)],
])  # fmt: skip
def test_the_request_schemas_take_what_the_parser_takes(kind, change, taken):
    import json

    from gateway.openai_request import parse_body, parse_chat, parse_completion

    base = {"model": "m", "messages": [USER]} if kind == "chat" else {"model": "m", "prompt": "hi"}
    body = base | change
    try:
        (parse_chat if kind == "chat" else parse_completion)(parse_body(json.dumps(body).encode()))
        parsed = True
    except ApiError:
        parsed = False
    assert parsed == taken, body  # the case's own premise
    schema = component("ChatCompletionRequest" if kind == "chat" else "CompletionRequest")
    assert schema.is_valid(body) == taken, [error.message for error in schema.iter_errors(body)][:2]
