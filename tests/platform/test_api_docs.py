"""The API's documentation reads as documentation: every operation has its own summary and description (never a
base class's docstring), operations are grouped by resource, and the OpenAI-compatible /v1 API is in it too."""

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(client):
    return client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


def test_every_operation_has_a_human_summary_and_description(schema):
    operations = [(method, path, op) for path, ops in schema["paths"].items() for method, op in ops.items()]
    assert len(operations) > 50
    for method, path, op in operations:
        summary, description = op.get("summary", ""), op.get("description", "")
        assert summary and summary[0].isupper() and "_" not in summary.split()[0], (method, path, summary)
        assert description and "Subclasses set" not in description, (method, path)


def test_operations_are_grouped_by_resource_and_v1_is_documented(schema):
    tags = {tag for ops in schema["paths"].values() for op in ops.values() for tag in op["tags"]}
    assert {"API keys", "Adapters", "Billing", "Request log", "Inference (OpenAI-compatible)",
            "Fine-tuning (OpenAI-compatible)"} <= tags  # fmt: skip
    assert "v1" not in tags and len(tags) >= 10
    assert {tag["name"] for tag in schema["tags"]} == tags
    assert schema["paths"]["/v1/chat/completions"]["post"]["summary"] == "Create a chat completion"
    assert "/v1/fine_tuning/jobs" in schema["paths"] and "/api/v1/requests" in schema["paths"]
