"""The management API's OpenAPI schema: every operation also documents the errors any caller can meet, in the
one error shape (quilt.api_errors), so the schema matches what the API answers."""

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
