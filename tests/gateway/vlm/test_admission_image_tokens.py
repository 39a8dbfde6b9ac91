"""The gateway counts a request's image tokens as the engine does, for each family: its admission count (budget
holds, tokens per minute) equals the prompt tokens the engine reports in usage for the same messages, including
the text Gemma 3's processor writes around each image."""

import asyncio

import pytest

from engine import LLM, SamplingParams
from gateway.caller import Target
from gateway.openai_request import parse_chat
from gateway.prompt_tokens import count_prompt_tokens
from gateway.request_images import load_images
from tests.engine.pictures import data_url, picture
from tests.engine.vlm_checkpoints import GEMMA3_IMAGE_TOKENS, build_vlm

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "w30 w31"},
    {"type": "image_url", "image_url": {"url": data_url(picture(90, 40, seed=1))}},
    {"type": "text", "text": "w32"},
    {"type": "image_url", "image_url": {"url": data_url(picture(45, 100, seed=2), "JPEG")}},
]}]  # fmt: skip


@pytest.mark.parametrize(("family", "layout"), [("gemma3", "transformers5"), ("qwen2_5_vl", "hub")])
def test_the_gateway_counts_the_prompt_tokens_the_engine_reports(family, layout, tmp_path):
    model_dir = build_vlm(tmp_path / family, family, seed=3, layout=layout)
    generation = parse_chat({"model": "vl", "messages": MESSAGES, "max_tokens": 1})
    target = Target(name="vl", base_model="vl", checkpoint_dir=str(model_dir), max_context=2048, adapter_id=None,
                    adapter_version_id=None, adapter_version=None, digest=None, adapter_path=None)  # fmt: skip
    asyncio.run(load_images(generation, target))
    counted = asyncio.run(count_prompt_tokens(generation, target))
    with LLM(str(model_dir), device="cpu", block_size=4, num_kv_blocks=256, max_num_batched_tokens=256) as llm:
        [output] = llm.generate([MESSAGES], SamplingParams(max_tokens=1))
    assert counted == len(output.prompt_token_ids)
    if family == "gemma3":  # each image's soft tokens and the text around them: "\n\n", <end_of_image>, "\n\n"
        assert counted > sum(generation.image_tokens) == 2 * GEMMA3_IMAGE_TOKENS
