"""Vision-language requests: Quilt's engine against transformers + PEFT on a random Qwen2.5-VL, Qwen3-VL or
Gemma 3, and a step's images encoded in one call against one call per image.

    .venv/bin/python -m benchmarks.vlm [--family qwen2_5_vl|qwen3_vl|gemma3] [--rounds 3] [--requests 16] [--images 8]
        [--threads N]
    python -m benchmarks.vlm --device cuda --dtype bfloat16 --shape real --family qwen2_5_vl   # a GPU

Both sides run in this process on one random checkpoint and one PEFT LoRA on the language model. --shape tiny
(CPU): tests/engine/vlm_checkpoints.py's tiny shape and small pictures. --shape real: the released model's vision
tower whole and its language model's widths (Qwen2.5-VL 7B, Qwen3-VL 8B, Gemma 3 4B) over --layers decoder layers
and the tiny vocabulary, with the released processors' settings and photo-sized pictures. The requests are chat
messages with one drawn picture each (several sizes), half of them for the adapter, fresh pictures each round;
every request generates --max-tokens tokens. The baseline is what a transformers user writes for images of different sizes: one generate() per request, the PeftModel's adapter switched on or
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
from transformers import Gemma3Config, Qwen2_5_VLConfig, Qwen3VLConfig
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
    VISION_END,
    VISION_START,
    VOCAB,
    build_vlm,
    build_vlm_adapter,
)

SIZES = {"tiny": [(90, 40), (45, 100), (120, 120), (64, 64), (150, 60)],  # width, height
         "real": [(640, 480), (448, 336), (512, 512), (336, 448), (800, 600)]}
# the released processors' settings (Qwen's default pixel range; Gemma 3's 896 x 896)
REAL_PROCESSORS = {"qwen2_5_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
                   "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                                "min_pixels": 64 * 64, "max_pixels": 32 * 32 * 1280},
                   "gemma3": {"size": {"height": 896, "width": 896}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}


def real_config(family: str, layers: int):
    """The released model's vision tower and language-model widths over `layers` decoder layers, with the tiny
    tokenizer's vocabulary and token ids (its embedding and head are tiny; the layers and the encoder are not)."""
    text = {"vocab_size": VOCAB, "num_hidden_layers": layers, "max_position_embeddings": 32768, "bos_token_id": 1,
            "eos_token_id": 2, "initializer_range": 0.02}
    tokens = {"image_token_id": IMAGE_TOKEN, "video_token_id": 153, "vision_start_token_id": VISION_START,
              "vision_end_token_id": VISION_END}
    if family == "qwen2_5_vl":  # Qwen2.5-VL-7B-Instruct
        text |= {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}}
        vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
                  "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=1, eos_token_id=2, **tokens)
    if family == "qwen3_vl":  # Qwen3-VL-8B-Instruct
        text |= {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                      "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
        vision = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
                  "patch_size": 16, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
        return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    # Gemma 3 4B: five sliding-window layers to one global
    text |= {"hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024, "bos_token_id": 2,
             "eos_token_id": 4, "pad_token_id": 0,
             "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
    vision = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
              "image_size": 896, "patch_size": 14, "vision_use_head": False}
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256, image_token_index=IMAGE_TOKEN,
                        boi_token_index=VISION_START, eoi_token_index=VISION_END, initializer_range=0.02)


def requests(count: int, round_: int, sizes: list[tuple[int, int]]) -> list[list[dict]]:
    """Fresh pictures each round: no prompt of a round is in the prefix cache from an earlier one."""
    out = []
    for i in range(count):
        url = data_url(picture(*sizes[i % len(sizes)], seed=1000 * round_ + i))
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": f"w{20 + i % 50} w30 w31"}]}])
    return out


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(llm: LLM, prompts, adapters, max_tokens: int) -> float:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, sampling, adapters=adapters)
    synchronize()
    return time.perf_counter() - start


@torch.no_grad()
def run_transformers(peft: PeftModel, processor, llm: LLM, prompts, adapters, max_tokens: int) -> float:
    device, dtype = peft.device, peft.dtype
    start = time.perf_counter()
    for messages, adapter in zip(prompts, adapters, strict=True):
        ids = torch.tensor([llm._chat(messages)[0]], device=device)  # the same prompt ids (rendering not timed apart)
        url = messages[0]["content"][0]["image_url"]["url"]
        features = processor([load_image(url)], return_tensors="pt")
        kwargs = {"pixel_values": features["pixel_values"].to(device, dtype), "max_new_tokens": max_tokens,
                  "min_new_tokens": max_tokens, "do_sample": False}
        if "image_grid_thw" in features:  # Qwen-VL
            kwargs |= {"image_grid_thw": features["image_grid_thw"].to(device), "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
        else:  # Gemma 3: its images' bidirectional mask
            kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).int()
        if adapter is None:
            with peft.disable_adapter():
                peft.generate(input_ids=ids, **kwargs)
        else:
            peft.generate(input_ids=ids, **kwargs)
    synchronize()
    return time.perf_counter() - start


def encode_ratio(llm: LLM, count: int, sizes: list[tuple[int, int]]) -> float:
    """Seconds of `count` images encoded one call each over the seconds of all of them in one call, each the best
    of five (other processes only ever slow a run)."""
    model, processor = llm.engine.runner.model, llm.engine.image_processor
    features = [processor(decode_data_url(data_url(picture(*sizes[i % len(sizes)], seed=100 + i))))
                for i in range(count)]
    pixels = [torch.from_numpy(f.pixels).to(llm.engine.runner.device) for f in features]  # float32, as the runner's
    with torch.inference_mode():
        model.encode_images(pixels[0], [features[0].grid_thw])  # warm-up
        single = batched = float("inf")
        for _ in range(5):
            synchronize()
            start = time.perf_counter()
            for p, f in zip(pixels, features, strict=True):
                model.encode_images(p, [f.grid_thw])
            synchronize()
            single = min(single, time.perf_counter() - start)
            start = time.perf_counter()
            model.encode_images(torch.cat(pixels), [f.grid_thw for f in features])
            synchronize()
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "real"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of --shape real")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    real, sizes = args.shape == "real", SIZES[args.shape]
    settings = REAL_PROCESSORS[args.family] if real else PROCESSORS[args.family]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_vlm(root / "base", args.family, seed=0, layout="transformers5",
                         config=real_config(args.family, args.layers) if real else None, processor_settings=settings)
        lora = build_vlm_adapter(base, root / "lora", seed=1, r=8)
        dtype = getattr(torch, args.dtype)
        hf = MODELS[args.family].from_pretrained(base, dtype=dtype).to(args.device).eval()
        peft = PeftModel.from_pretrained(hf, lora, adapter_name="lora").eval()
        processor = PROCESSOR_CLASSES.get(args.family, Qwen2VLImageProcessorPil)(**settings)
        adapters = ["lora" if i % 2 else None for i in range(args.requests)]
        batched_tokens = 8192 if real else 512  # a step prefills several photos' tokens
        with LLM(base, device=args.device, dtype=args.dtype, max_num_batched_tokens=batched_tokens,
                 max_adapter_rank=8) as llm:
            llm.add_adapter("lora", lora)
            warm_up = requests(2, args.rounds, sizes)
            run_engine(llm, warm_up, adapters[:2], 2)
            run_transformers(peft, processor, llm, warm_up, adapters[:2], 2)
            ratios, encodes = [], []
            for round_ in range(args.rounds):
                prompts = requests(args.requests, round_, sizes)
                if round_ % 2 == 0:
                    engine = run_engine(llm, prompts, adapters, args.max_tokens)
                    baseline = run_transformers(peft, processor, llm, prompts, adapters, args.max_tokens)
                else:
                    baseline = run_transformers(peft, processor, llm, prompts, adapters, args.max_tokens)
                    engine = run_engine(llm, prompts, adapters, args.max_tokens)
                ratios.append(baseline / engine)
                encodes.append(encode_ratio(llm, args.images, sizes))
                tokens = args.requests * args.max_tokens
                print(f"round {round_ + 1}: engine {tokens / engine:.0f} tok/s, transformers + PEFT "
                      f"{tokens / baseline:.0f} tok/s: {ratios[-1]:.2f}x; {args.images} images in one call "
                      f"{encodes[-1]:.2f}x faster than one call each")
    print(f"{args.family} ({args.shape}, {args.device}, {args.dtype}), {args.requests} image requests: engine/transformers + PEFT {spread(ratios)}")
    print(f"{args.images} images in one encoder call against one call each: {spread(encodes)}")


if __name__ == "__main__":
    main()
