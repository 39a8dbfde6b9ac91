"""A fine-tuning endpoint answers a method it does not serve with a 405 that says which it does (RFC 9110's Allow),
as the inference routes do."""

import asyncio
import json

from django.test import AsyncRequestFactory

from finetuning.views import _endpoint


def test_a_wrong_method_is_a_405_with_allow():
    view = _endpoint(get=lambda *args: None, post=lambda *args: None)
    response = asyncio.run(view(AsyncRequestFactory().delete("/v1/files")))
    assert response.status_code == 405
    assert response["Allow"] == "GET, POST"
    assert json.loads(response.content)["error"]["code"] == "method_not_allowed"
