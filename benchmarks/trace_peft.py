"""The transformers + PEFT side of benchmarks/gpu_trace.py, in its own process (its memory goes with it).

    python benchmarks/trace_peft.py WORKDIR [DEADLINE]   # reads WORKDIR/plan.json, writes WORKDIR/peft.json

What a PEFT user would write: one PeftModel holding the adapters, and for each adapter one batched,
left-padded `generate` over its requests, min/max new tokens forcing the longest output of the group
(only the tokens each request asked for are counted). Groups run in the order their adapter first
appears in the trace until `peft_seconds` of generation are spent, or until the next group would end
after DEADLINE (seconds since the epoch) at the pace of those before: the rest of the trace is left out
and the report scales from the groups measured. The file is rewritten after every group.

First, the correctness reference: for each of plan["reference"] (a prompt, an adapter or none), greedy
decoding one token at a time with the full prefix recomputed, keeping each chosen token's
log-probability and the gap between the top two; trace_engine.py scores the same tokens.
"""

import json
import sys
import time
from pathlib import Path

import torch


def main(work: Path, deadline: float) -> None:
    plan = json.loads((work / "plan.json").read_text())
    args, device = plan["args"], plan["device"]
    dtype = getattr(torch, plan["dtype"])
    if device == "cpu":
        torch.set_num_threads(1)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    result: dict = {"groups": []}
    start = time.perf_counter()
    kwargs = {"device_map": device} if device.startswith("cuda") else {}
    model = AutoModelForCausalLM.from_pretrained(plan["checkpoint"], dtype=dtype, **kwargs).eval()
    result["load_s"] = time.perf_counter() - start
    groups: dict[int, list[dict]] = {}
    for request in plan["trace"]:
        groups.setdefault(request["adapter"], []).append(request)
    chosen = list(groups)[: args["peft_max_groups"]]
    start = time.perf_counter()
    needed = chosen + [
        r["adapter"] for r in plan["reference"] if r["adapter"] is not None and r["adapter"] not in chosen
    ]
    for adapter_id in needed:
        path = plan["adapters"][str(adapter_id)]["path"]
        if not isinstance(model, PeftModel):
            model = PeftModel.from_pretrained(model, path, adapter_name=f"a{adapter_id}").eval()
        else:
            model.load_adapter(path, adapter_name=f"a{adapter_id}")
    result["adapters_load_s"] = time.perf_counter() - start
    with torch.inference_mode():
        result["reference"] = [_reference(model, r, device) for r in plan["reference"]]
        (work / "peft.json").write_text(json.dumps(result))
        model.set_adapter(f"a{chosen[0]}")
        _generate(
            model, [groups[chosen[0]][0]["prompt"][:8]], 2, device
        )  # warm-up: CUDA init, cuBLAS handles
        spent = 0.0
        for adapter_id in chosen:
            group = groups[adapter_id]
            new = max(r["max_tokens"] for r in group)
            done = result["groups"]
            pace = min((g["seconds"] / g["max_new"] for g in done), default=0.0)
            if spent >= args["peft_seconds"] or time.time() + pace * new > deadline:
                break
            model.set_adapter(f"a{adapter_id}")
            seconds = _generate(model, [r["prompt"] for r in group], new, device)
            spent += seconds
            result["groups"].append({
                "adapter": adapter_id, "requests": [r["index"] for r in group], "max_new": new,
                "tokens": sum(r["max_tokens"] for r in group), "seconds": seconds,
            })  # fmt: skip
            (work / "peft.json").write_text(json.dumps(result))
    (work / "peft.json").write_text(json.dumps(result))


def _reference(model, request: dict, device: str) -> dict:
    """Greedy tokens with their log-probabilities and top-2 gaps, the adapter on (or all adapters off)."""
    tokens = list(request["prompt"])
    generated, logprobs, gaps = [], [], []
    for _ in range(request["max_tokens"]):
        ids = torch.tensor([tokens], device=device)
        if request["adapter"] is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits[0, -1].float()
        else:
            model.set_adapter(f"a{request['adapter']}")
            logits = model(input_ids=ids).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = lp.topk(2)
        token = int(top.indices[0])
        generated.append(token)
        logprobs.append(float(top.values[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        tokens.append(token)
    return {**request, "tokens": generated, "logprobs": logprobs, "gaps": gaps}


def _generate(model, prompts: list[list[int]], new: int, device: str) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if out.shape[1] != width + new:
        raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, asked for {new}")
    return seconds


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else float("inf"))
