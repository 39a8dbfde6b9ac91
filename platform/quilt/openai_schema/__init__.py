"""The OpenAPI description of the OpenAI-compatible API under /v1: request and answer bodies, stream framing,
errors and headers, as the gateway serves them (gateway.openai_request, gateway.openai_response, finetuning.views).
`add_v1_paths` puts them into the schema drf-spectacular generates for the management API."""

from quilt.openai_schema.operations import FINE_TUNING, INFERENCE, SCHEMAS, add_v1_paths

__all__ = ["FINE_TUNING", "INFERENCE", "SCHEMAS", "add_v1_paths"]
