"""Qwen2.5-VL and Qwen3-VL against transformers (+ PEFT): chat messages with images drawn in code, rendered by the model's chat
template and preprocessed as its processor does, through the offline LLM; greedy tokens identical to
transformers' and the mean |log-probability difference| of the generated tokens at most 1e-3. Text only, one
image, two images of different sizes in one prompt, the same text with other images (no KV reused across
them, the same image's reused), prefilled in chunks over 4-token pages; both checkpoint layouts; on the
reference ops and on every Triton launcher under the interpreter."""

import json

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from adapters import AdapterError
from engine import LLM, SamplingParams
from engine.images import ImageError
from tests.engine.pictures import data_url, picture
from tests.engine.vlm_checkpoints import IMAGE_TOKEN, MODELS, PROJECTIONS, build_vlm, build_vlm_adapter

MAX_TOKENS = 5
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
CONFIG = {"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 16, "max_adapter_rank": 8}
IMAGES = {name: data_url(picture(*size, seed=seed), fmt) for name, size, seed, fmt in [
    ("wide", (90, 40), 1, "PNG"), ("tall", (45, 100), 2, "JPEG"), ("square", (120, 120), 3, "WEBP"),
    ("other-wide", (90, 40), 4, "PNG")]}


def chat(text: str, *images: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": IMAGES[name]}} for name in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CASES = {
    "text-only": [{"role": "user", "content": "w20 w21 w22 w23 w24 w25 w26"}],
    "one-image": chat("w30 w31 w32", "wide"),
    "two-images": chat("w40 w41", "tall", "square"),
    "same-text-image-a": chat("w50 w51 w52 w53", "wide"),
    "same-text-image-b": chat("w50 w51 w52 w53", "other-wide"),
}


LAYOUTS = [("qwen2_5_vl", "hub"), ("qwen2_5_vl", "transformers5"), ("qwen3_vl", "transformers5")]
# one batch that holds every case: text only, one image, two images of different sizes, the same text with
# another image; adapter and base requests
MIXED = {"names": ["same-text-image-a", "two-images", "text-only", "same-text-image-b", "one-image"],
         "adapters": ["lora", None, "lora", None, None]}


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(family, layout) -> its checkpoint directory and its LoRA's, each built once."""
    cache = {}

    def build(family: str, layout: str):
        if (family, layout) not in cache:
            base = build_vlm(tmp_path_factory.mktemp(f"{family}-{layout}"), family, seed=11, layout=layout)
            lora = build_vlm_adapter(base, tmp_path_factory.mktemp(f"{family}-{layout}-lora"), seed=12, r=4)
            cache[family, layout] = base, lora
        return cache[family, layout]
    return build


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: "-".join(p))
def checkpoint(request, built):
    return built(*request.param)[0]


def transformers_model(checkpoint):
    family = json.loads((checkpoint / "config.json").read_text())["model_type"]
    return MODELS[family].from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return transformers_model(checkpoint)


@torch.no_grad()
def transformers_greedy(model, processor, prompt: list[int], messages: list[dict], hf=None):
    """Greedy tokens and their log-probabilities as transformers' generate() makes them: the prompt with its
    pixels (from transformers' own processor and load_image) in one call, then one call per token over the KV
    cache (a generated token equal to the placeholder id is text, as in generate())."""
    content = messages[0]["content"]
    urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"] \
        if isinstance(content, list) else []
    ids = torch.tensor([prompt])
    extra = {}
    if urls:
        features = processor([load_image(url) for url in urls], return_tensors="pt")
        extra = {"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"],
                 "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
    (hf or model).model.rope_deltas = None  # what the last prompt left
    return greedy(model, ids, extra, MAX_TOKENS)



def greedy(model, ids: torch.Tensor, extra: dict, max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decode with its KV cache: the tokens and their log-probabilities; `extra` (the images'
    inputs) goes with the prompt's forward only."""
    tokens, logprobs, past = [], [], None
    for _ in range(max_tokens):
        out = model(ids, past_key_values=past, use_cache=True, **extra)
        row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tokens.append(int(row.argmax()))
        logprobs.append(float(row.max()))
        past, ids, extra = out.past_key_values, torch.tensor([[tokens[-1]]]), {}
    return tokens, logprobs

def oracle_processor(checkpoint) -> Qwen2VLImageProcessorPil:
    if (checkpoint / "preprocessor_config.json").exists():
        return Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    settings = json.loads((checkpoint / "processor_config.json").read_text())["image_processor"]
    return Qwen2VLImageProcessorPil(**{k: v for k, v in settings.items() if k != "image_processor_type"})


def check_against_transformers(llm, oracle, checkpoint, names) -> None:
    processor = oracle_processor(checkpoint)
    outputs = llm.generate([CASES[name] for name in names], SAMPLING)
    for name, out in zip(names, outputs, strict=True):
        prompt, _ = llm._chat(CASES[name])
        tokens, logprobs = transformers_greedy(oracle, processor, prompt, CASES[name])
        assert out.token_ids == tokens, name
        got = [entry.logprob for entry in out.logprobs]
        assert np.mean(np.abs(np.array(got) - np.array(logprobs))) <= 1e-3, name


def test_matches_transformers(checkpoint, oracle):
    with LLM(checkpoint, device="cpu", **CONFIG) as llm:
        check_against_transformers(llm, oracle, checkpoint, list(CASES))


def test_prefix_cache_keys_carry_the_images(checkpoint):
    """The same text and image again reuses the prompt's KV; the same text with another image of the same size
    (the same tokens) reuses none of the blocks that follow the image, and its tokens match transformers'."""
    with LLM(checkpoint, device="cpu", **CONFIG) as llm:
        first, again = (llm.generate([CASES["same-text-image-a"]], SAMPLING)[0] for _ in range(2))
        other = llm.generate([CASES["same-text-image-b"]], SAMPLING)[0]
        prompt_a, _ = llm._chat(CASES["same-text-image-a"])
        prompt_b, _ = llm._chat(CASES["same-text-image-b"])
    assert prompt_a == prompt_b
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= len(prompt_a) - CONFIG["block_size"]
    assert again.token_ids == first.token_ids
    assert other.usage.cached_tokens == 0


def check_mixed_batch_against_peft(base, adapter, *, static: bool = False, **config) -> None:
    """static: decode steps through the CUDA graphs' static buffers, run eagerly (the replay path on CPU); each
    of them must read its multimodal rope positions from the buffer."""
    hf = transformers_model(base)
    peft = PeftModel.from_pretrained(hf, adapter, adapter_name="lora").eval()
    names, adapters = MIXED["names"], MIXED["adapters"]
    processor = oracle_processor(base)
    with LLM(base, device="cpu", **{**CONFIG, **config}) as llm:
        llm.add_adapter("lora", adapter)
        if static:
            engine = llm.engine
            graphs = engine.runner.graphs = engine.runner.static_decode(
                max_batch=engine.config.max_num_seqs, max_model_len=engine.max_model_len,
                max_adapter_rank=engine.config.max_adapter_rank, capture=False,
                max_tokens=engine.config.max_num_batched_tokens)  # fmt: skip
            reads = []
            hook = engine.runner.model.register_forward_pre_hook(
                lambda _, args: reads.append((args[1].is_decode, args[1].mrope_positions.data_ptr())))
        outputs = llm.generate([CASES[name] for name in names], SAMPLING, adapters=adapters)
        prompts = [llm._chat(CASES[name])[0] for name in names]
        if static:
            hook.remove()
            decode_reads = [ptr for is_decode, ptr in reads if is_decode]
            assert graphs.steps == len(decode_reads) >= 2, "the decode steps did not go through the static buffers"
            assert set(decode_reads) == {graphs.buffers["mrope_positions"].data_ptr()}
    for name, name_of_adapter, prompt, out in zip(names, adapters, prompts, outputs, strict=True):
        if name_of_adapter is None:
            with peft.disable_adapter():
                tokens, logprobs = transformers_greedy(peft, processor, prompt, CASES[name], hf=hf)
        else:
            tokens, logprobs = transformers_greedy(peft, processor, prompt, CASES[name], hf=hf)
        assert out.token_ids == tokens, (name, name_of_adapter)
        got = [entry.logprob for entry in out.logprobs]
        assert np.mean(np.abs(np.array(got) - np.array(logprobs))) <= 1e-3, (name, name_of_adapter)


def test_adapter_and_base_requests_in_one_batch_match_peft(checkpoint, built, request):
    """A LoRA on the language model's seven projections, as PEFT names them on this model, for some requests of
    a batch and the base model for the others, with and without images, prefilled in 16-token chunks."""
    check_mixed_batch_against_peft(checkpoint, built(*request.node.callspec.params["checkpoint"])[1])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_decode_through_the_static_buffers_matches_peft(family, built):
    """What a CUDA graph replays, run eagerly: every decode step's (t, h, w) positions (its index plus the
    sequence's image offset, one row read as three) from the static buffer, the mixed batch still PEFT's."""
    check_mixed_batch_against_peft(*built(family, "transformers5"), static=True)


@pytest.mark.parametrize("family, static", [("qwen2_5_vl", False), ("qwen3_vl", True)])
def test_every_case_matches_peft_on_triton_launchers(family, static, built, triton_launchers):
    """The mixed batch with every op on its Triton launcher (interpreted), in longer chunks to keep it short. Qwen3-VL
    decodes through the static buffers (buffers for 8 sequences: a faster interpreter), so that its interleaved rope
    is read from them on the launchers too; its prefill is the same as on the eager path."""
    extra = {"max_num_seqs": 8} if static else {}
    check_mixed_batch_against_peft(*built(family, "transformers5"), static=static, max_num_batched_tokens=64, **extra)


def test_lora_on_the_vision_tower_is_refused(checkpoint, tmp_path):
    """target_modules that match the vision encoder (its attention's qkv; on Qwen2.5-VL the plain MLP names match
    its MLP too) are refused, at load, with the code the upload check gives."""
    path = build_vlm_adapter(checkpoint, tmp_path / "vision", seed=13, r=2, targets=[*PROJECTIONS, "qkv"])
    with LLM(checkpoint, device="cpu", **CONFIG) as llm, pytest.raises(AdapterError) as refused:
        llm.add_adapter("vision", path)
    assert refused.value.code == "unsupported_module"
    assert "vision tower" in str(refused.value)


def test_an_image_prefilled_over_several_chunks_is_encoded_once(checkpoint, oracle):
    """8-token chunks cut the 16-token image of "two-images" three ways: it still goes through the vision
    encoder once, and the tokens match transformers'."""
    encoded = []
    with LLM(checkpoint, device="cpu", **{**CONFIG, "max_num_batched_tokens": 8}) as llm:
        hook = llm.engine.runner.model.visual.register_forward_hook(
            lambda module, args, output: encoded.extend(args[1]))
        check_against_transformers(llm, oracle, checkpoint, ["two-images", "one-image"])
        hook.remove()
        assert not llm.engine.runner.encoded  # nothing kept past the images' last chunks
    assert len(encoded) == 3


def test_a_bad_image_refuses_the_whole_call_before_anything_runs(checkpoint):
    """A corrupt image in the second prompt: ImageError naming it, and the first prompt was never queued."""
    corrupt = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAA"}},
        {"type": "text", "text": "w30"}]}]
    with LLM(checkpoint, device="cpu", **CONFIG) as llm:
        with pytest.raises(ImageError, match="cannot be decoded"):
            llm.generate([CASES["one-image"], corrupt], SAMPLING)
        assert not llm.engine.has_unfinished()
        assert llm.generate([CASES["text-only"]], SAMPLING)[0].token_ids  # the engine serves on
