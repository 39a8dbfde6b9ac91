"""Checkpoints of a LoRA run: the adapter (as PEFT saves it), the optimizer and scheduler, and the step.

A checkpoint is written to a temporary folder and renamed into place, then `latest` is replaced to point at
it: a trainer killed at any moment leaves the previous checkpoint whole. Only the newest two are kept.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

LATEST = "latest"
KEEP = 2


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def _name(step: int) -> str:
    return f"step-{step:07d}"


def save(root: Path, *, step: int, model: PeftModel, optimizer, scheduler, metrics: dict) -> Checkpoint:
    root.mkdir(parents=True, exist_ok=True)
    target = root / _name(step)
    partial = root / f".{_name(step)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, partial / "optimizer.pt")
    (partial / "state.json").write_text(json.dumps({"step": step, "metrics": metrics}))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    pointer = root / f".{LATEST}.{os.getpid()}"
    pointer.write_text(target.name)
    os.replace(pointer, root / LATEST)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return Checkpoint(step=step, path=target)


def latest(root: Path) -> Checkpoint | None:
    try:
        name = (root / LATEST).read_text().strip()
        state = json.loads((root / name / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return Checkpoint(step=int(state["step"]), path=root / name)


def restore(checkpoint: Checkpoint, *, model: PeftModel, optimizer, scheduler) -> None:
    weights = load_file(str(checkpoint.path / "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights)
    state = torch.load(checkpoint.path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
