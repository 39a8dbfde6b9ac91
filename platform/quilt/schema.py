"""The management API's OpenAPI schema: every operation also documents the errors any caller can meet, in the
one error shape (quilt.api_errors), so the schema matches what the API answers."""

from decimal import Decimal

from drf_spectacular.openapi import AutoSchema
from rest_framework import serializers

from quilt.schema_text import access_text, own_docstring, summary_for, tag_for

ERROR_STATUSES = {
    "400": "The input is invalid (the message says which field and why).",
    "401": "No credential, or one that is not valid.",
    "403": "The credential's role or scopes do not allow this.",
    "404": "No such object in the caller's tenant.",
    "405": "The method is not allowed here.",
    "406": "The requested format can not be produced.",
    "409": "The object is not in a state that allows this (a key already revoked, an invitation no longer pending).",
    "422": "The input has the declared shape but asks for what can not be done (a date range reversed or longer "
           "than allowed, a plan that does not exist).",
}
BODY_ERROR_STATUSES = {"413": "The request body is too large.", "415": "The request body's media type is not accepted."}


class ErrorDetail(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    code = serializers.CharField()


class ErrorOutput(serializers.Serializer):
    error = ErrorDetail()


class QuiltAutoSchema(AutoSchema):
    def get_tags(self) -> list[str]:
        return [tag_for(self.path)]

    def get_summary(self) -> str | None:
        return summary_for(self.method, self.path)

    def get_description(self) -> str:
        summary = self.get_summary() or ""
        text = own_docstring(self.view, self.method) or f"{summary}."
        return f"{text}\n\n{access_text(self.view, self.method)}".strip()

    def _map_serializer_field(self, field, direction, bypass_extensions=False):
        """DRF's refusals the generator leaves out. A field's own pattern (a RegexValidator's: a slug, a username)
        comes first, as it is what the field checks; a CharField without one refuses a NUL character, and one that
        trims refuses a value that is blank once trimmed (so it needs a character str.strip() keeps) unless it may
        be blank, when such a value is its blank branch; a list that may not be empty needs an item."""
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if direction != "request":
            return schema
        self._insert_field_validators(field, schema)  # drf-spectacular runs it again after us: it adds nothing then
        if isinstance(field, serializers.CharField) and schema.get("type") == "string" \
                and "pattern" not in schema and "format" not in schema and "enum" not in schema:
            schema["pattern"] = NOT_BLANK if field.trim_whitespace else NOT_EMPTY
            self._insert_field_validators(field, schema)  # a field that may be blank: "" is a oneOf of its own
        if isinstance(field, serializers.CharField) and field.allow_blank and field.trim_whitespace \
                and "oneOf" in schema:  # what is blank once trimmed is taken as "": the blank branch is all of it
            schema["oneOf"] = [{"type": "string", "pattern": BLANK} if branch == _EMPTY else branch
                               for branch in schema["oneOf"]]
        if isinstance(field, serializers.ListField) and not field.allow_empty and schema.get("type") == "array":
            schema.setdefault("minItems", 1)
        if isinstance(field, serializers.DateTimeField) and schema.get("format") == "date-time":
            schema["pattern"] = DATETIME  # what Django parses: RFC 3339's lower-case t and z, leap seconds are not
        if isinstance(field, serializers.DecimalField) and schema.get("type") == "string" \
                and str(schema.get("pattern", "")).startswith("^"):
            schema["pattern"] = _decimal_pattern(field, schema["pattern"])
        return schema

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        statuses = dict(ERROR_STATUSES)
        if self.method in ("POST", "PUT", "PATCH"):
            statuses |= BODY_ERROR_STATUSES
        for status, description in statuses.items():
            if status not in responses:
                responses[status] = self._get_response_for_code(ErrorOutput, status, direction=direction)
                responses[status]["description"] = description
                content = responses[status].get("content") or {}  # errors are JSON, a CSV download's too
                responses[status]["content"] = {kind: body for kind, body in content.items() if "json" in kind}
        return responses


def _decimal_pattern(field: serializers.DecimalField, pattern: str) -> str:
    """The generator's decimal pattern as DRF reads it: ASCII digits only, at least one, no sign when the field has
    no negative values, and not zero when its least value is its smallest step."""
    body = pattern.removeprefix("^").replace("\\d", "[0-9]")
    lookahead = "(?=[^0-9]*[0-9])"
    if field.min_value is not None and field.min_value >= 0:
        body = body.removeprefix("-?")
        if field.decimal_places is not None and field.min_value == Decimal(1).scaleb(-field.decimal_places):
            lookahead += "(?![0.]*$)"
    return f"^{lookahead}{body}"


NO_NUL = r"^[^\x00]*$"  # PostgreSQL holds no NUL character: a parameter with one is refused (quilt.middleware)
# What DRF's CharField takes: no NUL character (its ProhibitNullCharactersValidator) and, where it may not be blank
# once trimmed, a character that str.strip() keeps. The characters it removes (str.isspace) are named one by one:
# ECMAScript's \s, the schema's dialect, leaves out \x1c-\x1f and \x85 and takes \ufeff, which strip() keeps.
STRIPPED = r"\t-\r\x1c- \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_EMPTY = r"^[^\x00]+$"
NOT_BLANK = rf"^[^\x00]*[^\x00{STRIPPED}][^\x00]*$"
BLANK = rf"^[{STRIPPED}]*$"
_EMPTY = {"type": "string", "maxLength": 0}  # drf-spectacular's branch for "" beside a field's format or pattern
DATETIME = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?(Z|[+-][0-9]{2}:[0-9]{2})$"


def describe_refusals(result, generator, request, public):
    """drf-spectacular postprocessing hook: the schema says what the API refuses, so that every request the schema
    allows is one the API takes. A request body takes only its declared fields (an unknown one is a 400); a string
    parameter in a path or query holds no NUL character; a URL whose suffix names the format (`usage.csv`) takes no
    `?format=`."""
    schemas = result.get("components", {}).get("schemas", {})
    bodies = set()
    for path, operations in result["paths"].items():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            if path.endswith(".csv"):  # the suffix names the format: ?format= there is a 400 (quilt.negotiation)
                operation["parameters"] = [parameter for parameter in operation.get("parameters", [])
                                           if (parameter["in"], parameter["name"]) != ("query", "format")]
            for content in (operation.get("requestBody") or {}).get("content", {}).values():
                ref = (content.get("schema") or {}).get("$ref", "")
                bodies.add(ref.rsplit("/", 1)[-1])
            for parameter in operation.get("parameters", []):
                schema = parameter.get("schema") or {}
                if schema.get("type") == "string" and "pattern" not in schema and "enum" not in schema \
                        and "format" not in schema:
                    schema["pattern"] = NO_NUL
    for name in bodies:
        if name in schemas and schemas[name].get("type") == "object":
            schemas[name]["additionalProperties"] = False
    return result
