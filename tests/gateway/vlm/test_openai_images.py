"""Images through the gateway with the unmodified `openai` package: an answer from the vision-language engine as
transformers gives it, with usage counting the image's tokens (as transformers' processor sizes the image); and
each bad image refused with an OpenAI-shaped 400 naming its content part, before anything is queued or billed."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as HFTokenizer
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.image_utils import load_image

from engine.tokenizer import Tokenizer
from tests.engine.pictures import data_url, picture
from tests.engine.test_vlm import oracle_processor, transformers_greedy
from tests.engine.vlm_checkpoints import IMAGE_TOKEN
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
    completion = client(vision_stack).chat.completions.create(
        model=BASE_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = oracle_prompt(vision_stack.model_dir, messages, [PICTURE])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vision_stack.model_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()  # fmt: skip
    expected, _ = transformers_greedy(model, oracle_processor(vision_stack.model_dir), prompt, messages)
    words = HFTokenizer.from_file(str(vision_stack.model_dir / "tokenizer.json"))
    assert [entry.token for entry in completion.choices[0].logprobs.content] == [words.decode([t]) for t in expected]
    assert completion.usage.prompt_tokens == len(prompt)
    assert prompt.count(IMAGE_TOKEN) > 1  # the image takes tokens of its own, counted as prompt tokens
    assert completion.usage.completion_tokens == MAX_TOKENS


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
