"""Correctness in bf16, judged against float32: the engine in bf16 and transformers + PEFT in bf16, each scored
against transformers + PEFT in float32 on the very same weights. bf16 moves every log-probability a
little; what matters is that the engine moves them no further than PEFT itself does.

    python benchmarks/gpu_precision.py --device cuda     # the suite's "precision" step
    python benchmarks/gpu_precision.py --tiny            # its dry run on CPU (a tiny model; bf16 on CPU)

A random Llama (bf16 weights on disk, so the float32 run reads exactly them) and random rank-16 PEFT adapters on
all seven projections (saved in bf16 too). transformers + PEFT in float32 decodes `--tokens` tokens greedily for
each prompt (adapters mixed, one prompt on the base model); then every position of prompt + continuation is
scored teacher-forced: by PEFT in float32 (the reference), by PEFT in bf16, and by the engine in bf16 (one batch,
`prompt_logprobs`). For each bf16 run: mean and max |log p - log p_fp32| of the token at each position, and the
positions where its top token differs from float32's where float32's top-2 gap exceeds 0.1 (decisive ones).
Verdict: the engine's mean distance is at most 1.1 x PEFT's and its decisive disagreements at most PEFT's + 1;
the exit status is 1 otherwise.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/

from benchmarks.work_folder import work_folder  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "default": (2048, 5632, 8, 16, 4, 32000),  # about 0.4 B parameters: seconds to build on a GPU
    "tiny": (128, 256, 2, 4, 2, 512),
}
DECISIVE_GAP = 0.1


def build(root: Path, shape: tuple, *, device: str, adapters: int, rank: int) -> tuple[Path, list[Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = shape
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=1024, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(root / "model")
    paths = []
    for i in range(adapters):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    std = 0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.05
                    param.copy_((torch.randn_like(param, dtype=torch.float32) * std).to(param.dtype))
        peft_model.save_pretrained(root / f"adapter-{i}")
        paths.append(root / f"adapter-{i}")
        model = peft_model.unload()  # the base again, without LoRA layers
    return root / "model", paths


def peft_model(model_dir: Path, adapters: list[Path], *, dtype: torch.dtype, device: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    return model.eval()


@torch.no_grad()
def peft_scores(model, sequences: list[list[int]], names: list[str | None], *, device: str) -> list[dict]:
    """Per sequence: log p of each token at positions 1.., the top token there and float32's top-2 gap."""
    out = []
    for tokens, name in zip(sequences, names, strict=True):
        ids = torch.tensor([tokens], device=device)
        if name is None:
            with model.disable_adapter():
                logits = model(ids).logits[0]
        else:
            model.set_adapter(name)
            logits = model(ids).logits[0]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [positions, vocab]: row i predicts token i + 1
        top2 = logp.topk(2, dim=-1).values
        out.append({"logprobs": logp.gather(1, ids[0, 1:, None])[:, 0].tolist(), "top": logp.argmax(-1).tolist(),
                    "gaps": (top2[:, 0] - top2[:, 1]).tolist()})  # fmt: skip
    return out


@torch.no_grad()
def peft_greedy(model, prompts: list[list[int]], names: list[str | None], *, tokens: int, device: str) -> list:
    sequences = []
    for prompt, name in zip(prompts, names, strict=True):
        seq = list(prompt)
        for _ in range(tokens):
            ids = torch.tensor([seq], device=device)
            if name is None:
                with model.disable_adapter():
                    logits = model(ids).logits[0, -1]
            else:
                model.set_adapter(name)
                logits = model(ids).logits[0, -1]
            seq.append(int(logits.float().argmax()))
        sequences.append(seq)
    return sequences


def engine_scores(model_dir: Path, adapters: list[Path], sequences, names, *, device: str) -> list[dict]:
    with LLM(model_dir, device=device, dtype="bfloat16", num_kv_blocks=256, block_size=16) as llm:
        for i, path in enumerate(adapters):
            llm.add_adapter(f"a{i}", path)
        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
        outputs = llm.generate(sequences, sampling, adapters=names)
    scores = []
    for tokens, output in zip(sequences, outputs, strict=True):
        entries = output.prompt_logprobs[1:]
        assert [e.token_id for e in entries] == tokens[1:]
        scores.append({"logprobs": [e.logprob for e in entries],
                       "top": [max(e.top, key=e.top.get) for e in entries]})  # fmt: skip
    return scores


def distance(run: list[dict], reference: list[dict]) -> dict:
    diffs, decisive, flips = [], 0, 0
    for got, want in zip(run, reference, strict=True):
        for logprob, top, ref_logprob, ref_top, gap in zip(got["logprobs"], got["top"], want["logprobs"],
                                                            want["top"], want["gaps"], strict=True):
            diffs.append(abs(logprob - ref_logprob))
            if gap > DECISIVE_GAP:
                decisive += 1
                flips += top != ref_top
    return {"positions": len(diffs), "mean_abs_logprob_diff": statistics.mean(diffs),
            "max_abs_logprob_diff": max(diffs), "decisive_positions": decisive, "top1_differs_decisive": flips}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's tiny model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    shape = SHAPES["tiny" if args.tiny else "default"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, shape[-1], (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    names = [None if i % 4 == 2 else f"a{i % 3}" for i in range(args.prompts)]  # mixed, some on the base model
    with work_folder("quilt-precision-") as work:
        model_dir, adapters = build(work, shape, device=args.device, adapters=3, rank=16)
        timings = {"build_s": time.perf_counter() - started}
        model = peft_model(model_dir, adapters, dtype=torch.float32, device=args.device)
        sequences = peft_greedy(model, prompts, names, tokens=args.tokens, device=args.device)
        reference = peft_scores(model, sequences, names, device=args.device)
        del model
        model = peft_model(model_dir, adapters, dtype=torch.bfloat16, device=args.device)
        peft_bf16 = peft_scores(model, sequences, names, device=args.device)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        timings["peft_s"] = time.perf_counter() - started - timings["build_s"]
        engine_bf16 = engine_scores(model_dir, adapters, sequences, names, device=args.device)
        timings["engine_s"] = time.perf_counter() - started - timings["build_s"] - timings["peft_s"]
    result = {"device": args.device, "shape": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads",
                                                        "vocab"), shape, strict=True)),
              "prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": args.tokens, **timings,
              "engine_bf16": distance(engine_bf16, reference), "peft_bf16": distance(peft_bf16, reference)}
    engine, peft = result["engine_bf16"], result["peft_bf16"]
    ok = (engine["mean_abs_logprob_diff"] <= 1.1 * peft["mean_abs_logprob_diff"]
          and engine["top1_differs_decisive"] <= peft["top1_differs_decisive"] + 1)  # fmt: skip
    result["verdict"] = "engine no further from float32 than PEFT" if ok else "engine FURTHER from float32 than PEFT"
    print(f"## gpu_precision on {args.device}{' (dry run: tiny model, bf16 on CPU)' if args.tiny else ''}: "
          f"hidden {shape[0]}, {shape[2]} layers, vocab {shape[5]}, {args.prompts} prompts of {args.prompt_len} + "
          f"{args.tokens} tokens, rank-16 adapters on 7 projections, against transformers + PEFT in float32")
    print("| run (bf16) | positions | mean abs dlogp | max abs dlogp | top-1 differs / decisive (gap > 0.1) |")
    print("|---|---:|---:|---:|---:|")
    for label, row in (("engine", engine), ("transformers + PEFT", peft)):
        print(f"| {label} | {row['positions']} | {row['mean_abs_logprob_diff']:.4f} | {row['max_abs_logprob_diff']:.4f} "
              f"| {row['top1_differs_decisive']} / {row['decisive_positions']} |")
    ratio = engine["mean_abs_logprob_diff"] / max(peft["mean_abs_logprob_diff"], 1e-12)
    print(f"engine / PEFT mean distance {ratio:.2f} (goal <= 1.1): {result['verdict']}; "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
