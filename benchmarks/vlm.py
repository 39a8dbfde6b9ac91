"""Vision-language requests on CPU: Quilt's engine against transformers + PEFT on a small Qwen2.5-VL, Qwen3-VL or
Gemma 3, and a step's images encoded in one call against one call per image.

    .venv/bin/python -m benchmarks.vlm [--family qwen2_5_vl|qwen3_vl|gemma3] [--rounds 3] [--requests 16] [--images 8]
        [--threads N]

Both sides run in this process on one random checkpoint (tests/engine/vlm_checkpoints.py's tiny shape) and one
PEFT LoRA on the language model. The requests are chat messages with one drawn picture each (several sizes),
half of them for the adapter, fresh pictures each round; every request generates --max-tokens tokens. The baseline is what a transformers
user writes for images of different sizes: one generate() per request, the PeftModel's adapter switched on or
off. Each round times both (the first goes first in odd rounds) and prints the ratio of wall times; then the
median and the spread (min, max) over the rounds. The encoder part times --images pictures through the engine's
vision tower in one call and one by one, and prints that ratio likewise.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine import LLM, SamplingParams
from engine.images import decode_data_url
from tests.engine.pictures import data_url, picture
from tests.engine.vlm_checkpoints import (
    IMAGE_TOKEN,
    MODELS,
    PROCESSOR_CLASSES,
    PROCESSORS,
    build_vlm,
    build_vlm_adapter,
)

SIZES = [(90, 40), (45, 100), (120, 120), (64, 64), (150, 60)]


def requests(count: int, round_: int) -> list[list[dict]]:
    """Fresh pictures each round: no prompt of a round is in the prefix cache from an earlier one."""
    out = []
    for i in range(count):
        url = data_url(picture(*SIZES[i % len(SIZES)], seed=1000 * round_ + i))
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": f"w{20 + i % 50} w30 w31"}]}])
    return out


def run_engine(llm: LLM, prompts, adapters, max_tokens: int) -> float:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, sampling, adapters=adapters)
    return time.perf_counter() - start


@torch.no_grad()
def run_transformers(peft: PeftModel, processor, llm: LLM, prompts, adapters, max_tokens: int) -> float:
    start = time.perf_counter()
    for messages, adapter in zip(prompts, adapters, strict=True):
        ids = torch.tensor([llm._chat(messages)[0]])  # the same prompt ids (rendering is not timed apart)
        url = messages[0]["content"][0]["image_url"]["url"]
        features = processor([load_image(url)], return_tensors="pt")
        kwargs = {"pixel_values": features["pixel_values"], "max_new_tokens": max_tokens,
                  "min_new_tokens": max_tokens, "do_sample": False}
        if "image_grid_thw" in features:  # Qwen-VL
            kwargs |= {"image_grid_thw": features["image_grid_thw"], "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
        else:  # Gemma 3: its images' bidirectional mask
            kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).int()
        if adapter is None:
            with peft.disable_adapter():
                peft.generate(input_ids=ids, **kwargs)
        else:
            peft.generate(input_ids=ids, **kwargs)
    return time.perf_counter() - start


def encode_ratio(llm: LLM, count: int) -> float:
    """Seconds of `count` images encoded one call each over the seconds of all of them in one call, each the best
    of five (other processes only ever slow a run)."""
    model, processor = llm.engine.runner.model, llm.engine.image_processor
    features = [processor(decode_data_url(data_url(picture(*SIZES[i % len(SIZES)], seed=100 + i))))
                for i in range(count)]
    pixels = [torch.from_numpy(f.pixels) for f in features]
    with torch.inference_mode():
        model.encode_images(pixels[0], [features[0].grid_thw])  # warm-up
        single = batched = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for p, f in zip(pixels, features, strict=True):
                model.encode_images(p, [f.grid_thw])
            single = min(single, time.perf_counter() - start)
            start = time.perf_counter()
            model.encode_images(torch.cat(pixels), [f.grid_thw for f in features])
            batched = min(batched, time.perf_counter() - start)
    return single / batched


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x (min {min(values):.2f}x, max {max(values):.2f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_vlm(root / "base", args.family, seed=0, layout="transformers5")
        lora = build_vlm_adapter(base, root / "lora", seed=1, r=8)
        hf = MODELS[args.family].from_pretrained(base, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(hf, lora, adapter_name="lora").eval()
        processor = PROCESSOR_CLASSES.get(args.family, Qwen2VLImageProcessorPil)(**PROCESSORS[args.family])
        adapters = ["lora" if i % 2 else None for i in range(args.requests)]
        with LLM(base, device="cpu", max_num_batched_tokens=512, max_adapter_rank=8) as llm:
            llm.add_adapter("lora", lora)
            warm_up = requests(2, round_=args.rounds)
            run_engine(llm, warm_up, adapters[:2], 2)
            run_transformers(peft, processor, llm, warm_up, adapters[:2], 2)
            ratios, encodes = [], []
            for round_ in range(args.rounds):
                prompts = requests(args.requests, round_)
                if round_ % 2 == 0:
                    engine = run_engine(llm, prompts, adapters, args.max_tokens)
                    baseline = run_transformers(peft, processor, llm, prompts, adapters, args.max_tokens)
                else:
                    baseline = run_transformers(peft, processor, llm, prompts, adapters, args.max_tokens)
                    engine = run_engine(llm, prompts, adapters, args.max_tokens)
                ratios.append(baseline / engine)
                encodes.append(encode_ratio(llm, args.images))
                tokens = args.requests * args.max_tokens
                print(f"round {round_ + 1}: engine {tokens / engine:.0f} tok/s, transformers + PEFT "
                      f"{tokens / baseline:.0f} tok/s: {ratios[-1]:.2f}x; {args.images} images in one call "
                      f"{encodes[-1]:.2f}x faster than one call each")
    print(f"{args.family}, {args.requests} image requests: engine/transformers + PEFT {spread(ratios)}")
    print(f"{args.images} images in one encoder call against one call each: {spread(encodes)}")


if __name__ == "__main__":
    main()
