"""The gateway's Prometheus metrics: per tenant, model and adapter, behind the metrics token."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import BASE_MODEL, METRICS_TOKEN, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def scrape(stack, token: str | None = METRICS_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(stack.gateways[0].removesuffix("/v1") + "/metrics", headers=headers, timeout=10)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def test_requests_ttft_tokens_and_refusals_by_tenant_model_and_adapter(stack):
    assert scrape(stack, token=None).status_code == 401
    assert scrape(stack, token="wrong").status_code == 401
    tenant = str(stack.ids["main"])
    api = client(stack, stack.keys["main"], gateway=0)
    stream = api.chat.completions.create(model="support", messages=[{"role": "user", "content": "w3 w4"}],
                                         max_tokens=3, stream=True, stream_options={"include_usage": True})  # fmt: skip
    usage = list(stream)[-1].usage
    with pytest.raises(openai.RateLimitError):
        client(stack, stack.keys["broke"], gateway=0).completions.create(model=BASE_MODEL, prompt="w1", max_tokens=2)

    response = scrape(stack)
    assert response.status_code == 200
    found = samples(response.text)
    support = {("tenant", tenant), ("model", "support")}
    ok = [v for (name, labels), v in found.items()
          if name == "quilt_gateway_requests_total" and support <= labels and ("outcome", "ok") in labels]  # fmt: skip
    assert ok and ok[0] >= 1
    adapters = {dict(labels)["adapter"] for (name, labels) in found if name == "quilt_gateway_requests_total"
                and support <= labels}  # fmt: skip
    assert len(adapters) == 1 and adapters != {"base"}  # the adapter's digest prefix
    ttft = [v for (name, labels), v in found.items() if name == "quilt_gateway_ttft_seconds_count" and support <= labels]
    assert ttft and ttft[0] >= 1
    completion = [v for (name, labels), v in found.items()
                  if name == "quilt_gateway_tokens_total" and support | {("kind", "completion")} <= labels]  # fmt: skip
    assert completion and completion[0] >= usage.completion_tokens
    refused = [v for (name, labels), v in found.items() if name == "quilt_gateway_refusals_total"
               and ("tenant", str(stack.ids["broke"])) in labels]  # fmt: skip
    assert refused and refused[0] >= 1
