"""Gemma 3 with images against transformers (+ PEFT): chat messages with images drawn in code, rendered by the
model's chat template and expanded as Gemma3Processor expands them, through the offline LLM; greedy tokens
identical to transformers' and the mean |log-probability difference| of the generated tokens at most 1e-3.
Text only, one image, two images, the same text with other images, adapter and base requests in one batch;
images wider than the sliding window, attended both ways; prefilled in chunks that never cut an image; both
checkpoint layouts; on the reference ops and on every Triton launcher under the interpreter."""

import json

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import Gemma3Processor, PreTrainedTokenizerFast
from transformers.image_utils import load_image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from adapters import AdapterError
from engine import LLM, SamplingParams
from tests.engine.test_vlm import CASES, IMAGES, greedy
from tests.engine.vlm_checkpoints import (
    GEMMA3_IMAGE_TOKENS,
    IMAGE_TOKEN,
    MODELS,
    build_vlm,
    build_vlm_adapter,
)

MAX_TOKENS = 5
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
CONFIG = {"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 20, "max_adapter_rank": 8}
# text before the image: three full blocks of it, then the image
TEXT_THEN_IMAGE = {name: [{"role": "user", "content": [{"type": "text", "text": "w60 w61 w62 w63 w64 w65 w66 w67"},
                                                       {"type": "image_url", "image_url": {"url": IMAGES[name]}}]}]
                   for name in ("wide", "other-wide")}
MIXED = {"names": ["same-text-image-a", "two-images", "text-only", "same-text-image-b", "one-image"],
         "adapters": ["lora", None, "lora", None, None]}


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    """layout -> the tiny Gemma 3's checkpoint directory and its LoRA's, each built once."""
    cache = {}

    def build(layout: str):
        if layout not in cache:
            base = build_vlm(tmp_path_factory.mktemp(f"gemma3-{layout}"), "gemma3", seed=11, layout=layout)
            cache[layout] = base, build_vlm_adapter(base, tmp_path_factory.mktemp("gemma3-lora"), seed=12, r=4)
        return cache[layout]
    return build


@pytest.fixture(scope="module", params=["hub", "transformers5"])
def built(request, gemma3):
    return gemma3(request.param)


@pytest.fixture(scope="module")
def oracle(built):
    return MODELS["gemma3"].from_pretrained(built[0], dtype=torch.float32, attn_implementation="eager").eval()


def processor_of(checkpoint) -> Gemma3Processor:
    """transformers' own Gemma 3 processor over the checkpoint's tokenizer and image settings."""
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    named = {key: tokenizer_config[key] for key in ("boi_token", "eoi_token", "image_token")}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), extra_special_tokens=named)
    if (checkpoint / "preprocessor_config.json").exists():
        images = Gemma3ImageProcessorPil.from_pretrained(checkpoint)
    else:
        settings = json.loads((checkpoint / "processor_config.json").read_text())["image_processor"]
        images = Gemma3ImageProcessorPil(**{k: v for k, v in settings.items() if k != "image_processor_type"})
    return Gemma3Processor(images, tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS)


@torch.no_grad()
def transformers_greedy(model, processor, llm, messages: list[dict]):
    """transformers' prompt (Gemma3Processor over the chat template's text) and its greedy tokens and their
    log-probabilities as generate() makes them: the prompt in one call, with its pixels and token_type_ids (the
    images' bidirectional mask), then one call per token over the KV cache."""
    content = messages[0]["content"]
    urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"] \
        if isinstance(content, list) else []
    hf_messages = [{**m, "content": [{"type": "image"} if part["type"] == "image_url" else part
                                     for part in m["content"]]} if isinstance(m["content"], list) else m
                   for m in messages]  # transformers' form of an image part
    text = llm.engine.tokenizer.apply_chat_template(hf_messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[load_image(url) for url in urls] or None, return_tensors="pt",
                       add_special_tokens=False)
    ids = inputs["input_ids"]
    extra = {"pixel_values": inputs["pixel_values"], "token_type_ids": inputs["token_type_ids"]} if urls else {}
    tokens, logprobs = greedy(model, ids, extra, MAX_TOKENS)
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def check(llm, model, processor, names, adapters=None, hf=None) -> None:
    adapters = adapters or [None] * len(names)
    outputs = llm.generate([CASES[name] for name in names], SAMPLING, adapters=adapters)
    for name, adapter, out in zip(names, adapters, outputs, strict=True):
        if adapter is None and hf is not None:
            with model.disable_adapter():
                prompt, tokens, logprobs = transformers_greedy(model, processor, llm, CASES[name])
        else:
            prompt, tokens, logprobs = transformers_greedy(model, processor, llm, CASES[name])
        assert llm._chat(CASES[name])[0] == prompt, name
        assert out.token_ids == tokens, (name, adapter)
        got = [entry.logprob for entry in out.logprobs]
        assert np.mean(np.abs(np.array(got) - np.array(logprobs))) <= 1e-3, (name, adapter)


def test_matches_transformers(built, oracle):
    with LLM(built[0], device="cpu", **CONFIG) as llm:
        check(llm, oracle, processor_of(built[0]), list(CASES))


def test_images_cut_by_the_chunk_budget_are_prefilled_whole(built, oracle):
    """18-token chunks would end inside both 16-token images of "two-images": each chunk stops before an image
    or takes all of it (the scheduler's rule), and the tokens still match transformers'."""
    with LLM(built[0], device="cpu", **{**CONFIG, "max_num_batched_tokens": 18}) as llm:
        check(llm, oracle, processor_of(built[0]), ["two-images", "one-image"])


def test_an_image_wider_than_a_chunk_is_refused(built):
    with LLM(built[0], device="cpu", **{**CONFIG, "max_num_batched_tokens": 12}) as llm:
        with pytest.raises(ValueError, match="an image of 16 tokens is prefilled in one chunk"):
            llm.generate([CASES["one-image"]], SAMPLING)
        assert llm.generate([CASES["text-only"]], SAMPLING)[0].token_ids  # the engine serves on


def test_prefix_cache_keys_carry_the_images(built, oracle):
    """The same text and image again reuses the prompt's KV (its hit ends inside the image, whose rest is then
    prefilled whole); the same text with another image reuses only the blocks before the image; every answer
    matches transformers'."""
    processor = processor_of(built[0])
    with LLM(built[0], device="cpu", **CONFIG) as llm:
        first, again = (llm.generate([CASES["same-text-image-a"]], SAMPLING)[0] for _ in range(2))
        other = llm.generate([CASES["same-text-image-b"]], SAMPLING)[0]
        prompt, tokens, _ = transformers_greedy(oracle, processor, llm, CASES["same-text-image-a"])
        _, other_tokens, _ = transformers_greedy(oracle, processor, llm, CASES["same-text-image-b"])
    blocks_before_image = prompt.index(IMAGE_TOKEN) // CONFIG["block_size"]
    assert first.usage.cached_tokens == 0
    assert other.usage.cached_tokens == blocks_before_image * CONFIG["block_size"]
    assert again.usage.cached_tokens >= len(prompt) - CONFIG["block_size"]
    assert first.token_ids == again.token_ids == tokens
    assert other.token_ids == other_tokens


def check_mixed_batch_against_peft(base, adapter, **config) -> None:
    hf = MODELS["gemma3"].from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    peft = PeftModel.from_pretrained(hf, adapter, adapter_name="lora").eval()
    with LLM(base, device="cpu", **{**CONFIG, **config}) as llm:
        llm.add_adapter("lora", adapter)
        check(llm, peft, processor_of(base), MIXED["names"], MIXED["adapters"], hf=hf)


def test_adapter_and_base_requests_in_one_batch_match_peft(built):
    """A LoRA on the language model's seven projections, as PEFT names them on Gemma 3, for some requests of a
    batch and the base model for the others, with and without images."""
    check_mixed_batch_against_peft(*built)


def test_every_case_matches_peft_on_triton_launchers(gemma3, triton_launchers):
    """The mixed batch with every op on its Triton launcher (interpreted), one layout: the images' bidirectional
    attention through the prefill kernel's key limits."""
    check_mixed_batch_against_peft(*gemma3("transformers5"), max_num_batched_tokens=64)


def test_lora_on_the_vision_tower_is_refused(built, tmp_path):
    """Plain projection names also match SigLIP's q/k/v projections, and fc1 its MLP: refused at load with the
    code the upload check gives."""
    path = build_vlm_adapter(built[0], tmp_path / "vision", seed=13, r=2, targets=["q_proj", "v_proj", "fc1"])
    with LLM(built[0], device="cpu", **CONFIG) as llm, pytest.raises(AdapterError) as refused:
        llm.add_adapter("vision", path)
    assert refused.value.code == "unsupported_module"
    assert "vision tower" in str(refused.value)


def test_prompts_with_other_images_share_only_the_blocks_before_them(built, oracle):
    """The same text, then another image: the blocks before the image are prefix hits, the image's and every later
    one are not (their keys carry the image's digest); kv_keys, which names blocks between engines, agrees; the
    answers match transformers'."""
    processor, size = processor_of(built[0]), CONFIG["block_size"]
    with LLM(built[0], device="cpu", **CONFIG) as llm:
        wide, other = (llm.generate([TEXT_THEN_IMAGE[name]], SAMPLING)[0] for name in ("wide", "other-wide"))
        prompt, wide_images = llm._chat(TEXT_THEN_IMAGE["wide"])
        other_prompt, other_images = llm._chat(TEXT_THEN_IMAGE["other-wide"])
        wide_keys = llm.engine.kv_keys(prompt, images=wide_images)
        other_keys = llm.engine.kv_keys(other_prompt, images=other_images)
        expected = [transformers_greedy(oracle, processor, llm, TEXT_THEN_IMAGE[name])[1]
                    for name in ("wide", "other-wide")]
    shared = prompt.index(IMAGE_TOKEN) // size
    assert prompt == other_prompt and shared == 3
    assert other.usage.cached_tokens == shared * size
    assert wide_keys[:shared] == other_keys[:shared]
    assert all(a != b for a, b in zip(wide_keys[shared:], other_keys[shared:], strict=True))
    assert [wide.token_ids, other.token_ids] == expected
