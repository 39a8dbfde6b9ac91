"""Images through the gateway with the unmodified `openai` package: an answer from the vision-language engine as
transformers gives it, with usage counting the image's tokens (as transformers' processor sizes the image); and
each bad image refused with an OpenAI-shaped 400 naming its content part, before anything is queued or billed."""

import asyncio
import base64
import io
from decimal import Decimal

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as HFTokenizer
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.image_utils import load_image

from engine.tokenizer import Tokenizer
from gateway.caller import Target
from gateway.openai_request import parse_chat
from gateway.prompt_tokens import count_prompt_tokens
from gateway.request_images import load_images
from metering.models import UsageEvent
from metering.pricing import Rates, request_price
from tests.engine.pictures import data_url, picture
from tests.engine.test_vlm import oracle_processor, transformers_greedy
from tests.engine.vlm_checkpoints import IMAGE_TOKEN
from tests.gateway.conftest import wait_until
from tests.gateway.vlm.conftest import (
    BASE_MODEL,
    IMAGE_MAX_BYTES,
    IMAGE_MAX_PIXELS,
    IMAGES_PER_REQUEST,
    client,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

MAX_TOKENS = 5
PICTURE = data_url(picture(90, 40, seed=1))


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": part} if isinstance(part, str) else {"type": "image_url", "image_url": part}
        for part in parts]}]  # fmt: skip


def usage_row(request_id: str) -> UsageEvent:
    return wait_until(lambda: UsageEvent.answered.filter(request_id=request_id, status_code__isnull=False).first(),
                      timeout=30, what=f"the request log's row of {request_id}")  # fmt: skip


def oracle_prompt(model_dir, messages: list[dict], urls: list[str]) -> list[int]:
    """The prompt's ids: the chat template's text, each image placeholder repeated for the tokens transformers'
    processor gives the image (its grid's patches over merge_size ** 2)."""
    grids = oracle_processor(model_dir)([load_image(url) for url in urls], return_tensors="pt")["image_grid_thw"]
    counts = iter((grids.prod(dim=-1) // 4).tolist())
    text = Tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=True)
    ids = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    return [t for token in ids for t in ([token] * next(counts) if token == IMAGE_TOKEN else [token])]


def test_an_image_is_answered_as_transformers_answers_and_its_tokens_are_prompt_tokens(vision_stack):
    messages = user({"url": PICTURE, "detail": "low"}, "w30 w31 w32")
    raw = client(vision_stack).chat.completions.with_raw_response.create(
        model=BASE_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    completion = raw.parse()
    prompt = oracle_prompt(vision_stack.model_dir, messages, [PICTURE])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vision_stack.model_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()  # fmt: skip
    expected, _ = transformers_greedy(model, oracle_processor(vision_stack.model_dir), prompt, messages)
    words = HFTokenizer.from_file(str(vision_stack.model_dir / "tokenizer.json"))
    assert [entry.token for entry in completion.choices[0].logprobs.content] == [words.decode([t]) for t in expected]
    assert completion.usage.prompt_tokens == len(prompt)
    assert prompt.count(IMAGE_TOKEN) > 1  # the image takes tokens of its own, counted as prompt tokens
    assert completion.usage.completion_tokens == MAX_TOKENS
    row = usage_row(raw.headers["x-request-id"])  # the request log: the image counted, never stored
    assert (row.prompt_tokens, row.image_count, row.image_tokens) == (len(prompt), 1, prompt.count(IMAGE_TOKEN))
    assert row.price == request_price(rates=Rates(input=Decimal("2"), cached_input=Decimal("1"), output=Decimal("8")),
                                      prompt_tokens=len(prompt), cached_tokens=row.cached_tokens,
                                      completion_tokens=MAX_TOKENS)  # fmt: skip


def test_admission_counts_the_image_tokens_before_the_call(vision_stack, settings):
    """The tokens a budget hold and tokens per minute take for a request with images are its prompt tokens as the
    engine will count them, images included."""
    settings.QUILT_IMAGE_MAX_BYTES, settings.QUILT_IMAGE_MAX_PIXELS = IMAGE_MAX_BYTES, IMAGE_MAX_PIXELS
    other = data_url(picture(45, 100, seed=2), "JPEG")
    messages = user({"url": PICTURE}, "w30 w31", {"url": other})
    generation = parse_chat({"model": BASE_MODEL, "messages": messages, "max_tokens": 2})
    target = Target(name=BASE_MODEL, base_model=BASE_MODEL, checkpoint_dir=str(vision_stack.model_dir),
                    max_context=512, adapter_id=None, adapter_version_id=None, adapter_version=None, digest=None,
                    adapter_path=None)  # fmt: skip
    asyncio.run(load_images(generation, target))
    prompt = oracle_prompt(vision_stack.model_dir, messages, [PICTURE, other])
    assert asyncio.run(count_prompt_tokens(generation, target)) == len(prompt)
    assert sum(generation.image_tokens) == prompt.count(IMAGE_TOKEN)


def _noise_png(width: int, height: int) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _truncated(url: str) -> str:
    header, payload = url.split(",")
    return f"{header},{payload[: len(payload) // 2 // 4 * 4]}"  # half the file, still whole base64


BAD = {
    "truncated": ({"url": _truncated(PICTURE)}, "invalid_image", "cannot be decoded"),
    "not-an-image": ({"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not a png").decode()},
                     "invalid_image", "not a png, jpeg or webp"),
    "not-base64": ({"url": "data:image/png;base64,@@@@"}, "invalid_image", "base64"),
    "unsupported-type": ({"url": "data:image/gif;base64,R0lGODlhAQABAAAAACw="}, "invalid_image", "unsupported"),
    "oversized-bytes": ({"url": _noise_png(200, 200)}, "invalid_image", f"larger than {IMAGE_MAX_BYTES} bytes"),
    "oversized-pixels": ({"url": data_url(picture(400, 300, seed=2), "JPEG", quality=30)}, "invalid_image",
                         f"more than {IMAGE_MAX_PIXELS}"),
    "http-url": ({"url": "http://169.254.169.254/latest/meta-data/"}, "image_url_not_allowed",
                 "not fetched by this server"),
    "bad-detail": ({"url": PICTURE, "detail": "ultra"}, "invalid_value", "detail"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_image_is_a_400_naming_its_content_part(vision_stack, case):
    image_url, code, words = BAD[case]
    assert len(_noise_png(200, 200)) * 3 // 4 > IMAGE_MAX_BYTES  # the oversized case is over the limit
    with pytest.raises(openai.BadRequestError) as raised:
        client(vision_stack).chat.completions.create(model=BASE_MODEL, messages=user("w30", image_url), max_tokens=2)
    error = raised.value
    assert error.status_code == 400 and error.code == code, error.body
    assert error.param == "messages.[0].content.[1]"
    assert words in error.message
    row = usage_row(error.response.headers["x-request-id"])  # logged as a refusal: nothing held, nothing billed
    assert (row.status_code, row.prompt_tokens, row.price) == (400, 0, 0)


def test_more_images_than_a_request_may_carry_are_refused_at_the_first_surplus_one(vision_stack):
    parts = [{"url": PICTURE}] * (IMAGES_PER_REQUEST + 1)
    with pytest.raises(openai.BadRequestError) as raised:
        client(vision_stack).chat.completions.create(model=BASE_MODEL, messages=user("w30", *parts), max_tokens=2)
    assert raised.value.code == "too_many_images"
    assert raised.value.param == f"messages.[0].content.[{IMAGES_PER_REQUEST + 1}]"


def test_an_image_in_an_assistant_message_is_refused(vision_stack):
    messages = [*user("w30"), {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": PICTURE}}]}]
    with pytest.raises(openai.BadRequestError) as raised:
        client(vision_stack).chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=2)
    assert raised.value.param == "messages.[1].content.[0]"


def test_the_documented_schema_takes_image_parts_in_user_messages_only():
    from tests.gateway.v1_schema import component

    schema = component("ChatCompletionRequest")
    body = {"model": BASE_MODEL, "messages": user({"url": PICTURE, "detail": "high"}, "w30")}
    assert not list(schema.iter_errors(body))
    assistant = {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": PICTURE}}]}
    assert list(schema.iter_errors(body | {"messages": [*body["messages"], assistant]}))
    assert list(schema.iter_errors(body | {"messages": user({"url": PICTURE, "detail": "ultra"})}))


def test_a_request_with_images_is_served_by_one_engine_without_a_prefill_hop(vision_stack):
    """The engine moves no KV for a prompt with images: the gateway never routes one through a prefill engine
    (here one that cannot be reached, so that a hop tried is counted as a fallback)."""
    import time
    from types import SimpleNamespace

    from tests.gateway.conftest import free_port
    from tests.gateway.test_disaggregation import SNAPSHOT, counter, heartbeat

    stack = SimpleNamespace(gateways=[vision_stack.gateway])
    dead, long_text = f"http://127.0.0.1:{free_port()}", " ".join(f"w{i % 90 + 10}" for i in range(150))
    heartbeat(stack, "vl-prefill-dead", dead, role="prefill")
    try:
        time.sleep(SNAPSHOT + 0.2)
        before = counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"')
        api = client(vision_stack)
        answer = api.chat.completions.create(model=BASE_MODEL, messages=user({"url": PICTURE}, long_text), max_tokens=2)
        assert answer.choices and counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"') == before
        api.chat.completions.create(model=BASE_MODEL, messages=user(long_text + " w11"), max_tokens=2)  # text: tried
        assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"') == before + 1
    finally:
        heartbeat(stack, "vl-prefill-dead", dead, role="prefill", draining=True)
        time.sleep(SNAPSHOT + 0.2)


def test_a_streamed_image_request_ends_with_the_usage_of_the_whole_one(vision_stack):
    messages = user("w40 w41", {"url": PICTURE})
    whole = client(vision_stack).chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=4,
                                                         temperature=0)  # fmt: skip
    chunks = list(client(vision_stack).chat.completions.create(
        model=BASE_MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert whole.usage.prompt_tokens == len(oracle_prompt(vision_stack.model_dir, messages, [PICTURE]))
