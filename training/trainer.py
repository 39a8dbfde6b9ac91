"""The LoRA training loop (transformers + PEFT, CPU or CUDA): supervised fine-tuning and DPO.

Batches come from `training.steps`, so a resumed run trains on the batches the killed one would have.
`Progress` hears every step and may stop the run between steps (cancel, lost lease); checkpoints are written every
`checkpoint_every` steps and at the end.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from adapters.base_shapes import BaseShapes
from training import checkpoints
from training.dataset import DPO
from training.encoding import IGNORE, Encoded, PreferenceTokens, SupervisedTokens
from training.steps import Hyperparameters, batch_indices, total_steps

MAX_VALIDATION_EXAMPLES = 256


@dataclass(frozen=True)
class TrainingRun:
    base_dir: Path  # a Hugging Face checkpoint folder
    method: str
    train: list[Encoded]
    validation: list[Encoded]
    hyperparameters: Hyperparameters
    work_dir: Path  # checkpoints/ and adapter/ go here
    checkpoint_every: int
    device: str = "cpu"


@dataclass(frozen=True)
class Metrics:
    step: int  # 1-based: steps done
    total_steps: int
    train_loss: float
    train_mean_token_accuracy: float | None
    valid_loss: float | None = None


class Progress(Protocol):
    def resumed(self, *, step: int) -> None: ...

    def step(self, metrics: Metrics) -> bool:
        """Called after each step; False stops the run before the next one."""

    def checkpoint(self, *, step: int, path: Path, metrics: Metrics) -> None: ...


@dataclass(frozen=True)
class Result:
    adapter_dir: Path | None  # None when stopped early
    steps: int
    trained_tokens: int


def trained_tokens(run: TrainingRun, steps: int) -> int:
    """Tokens of every example in the first `steps` steps (what a tenant is billed for)."""
    count = len(run.train)
    return sum(run.train[i].tokens for s in range(steps) for i in batch_indices(count, run.hyperparameters, s))


# -- batches ------------------------------------------------------------------------------------------------------

def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [batch, width]
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [batch, width]
    for row, (ids, row_labels) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def _supervised_rows(examples: list[SupervisedTokens]) -> list[tuple[list[int], list[int]]]:
    return [(e.input_ids, e.labels) for e in examples]


def _preference_rows(examples: list[PreferenceTokens]) -> list[tuple[list[int], list[int]]]:
    """Preferred answers first, then the non-preferred ones, each after its prompt."""
    rows = []
    for answers in ("preferred_ids", "non_preferred_ids"):
        for e in examples:
            answer = getattr(e, answers)
            rows.append((e.prompt_ids + answer, [IGNORE] * len(e.prompt_ids) + answer))
    return rows


def _token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of the labelled tokens' log-probabilities, and the mask of labelled positions."""
    logits, labels = logits[:, :-1], labels[:, 1:]  # position t predicts token t + 1
    mask = labels != IGNORE
    picked = torch.gather(F.log_softmax(logits.float(), dim=-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(dim=-1), mask  # [batch], [batch, width - 1]


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != IGNORE
    hits = (logits.argmax(dim=-1) == labels) & mask
    return hits.sum().item() / max(1, mask.sum().item())


def _supervised_loss(model: PeftModel, batch: dict) -> tuple[torch.Tensor, float]:
    output = model(**batch)
    return output.loss, _accuracy(output.logits.detach(), batch["labels"])


def _dpo_loss(model: PeftModel, batch: dict, beta: float) -> tuple[torch.Tensor, float]:
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    policy, _ = _token_logprobs(model(**inputs).logits, batch["labels"])
    with torch.no_grad(), model.disable_adapter():
        reference, _ = _token_logprobs(model(**inputs).logits, batch["labels"])
    half = policy.shape[0] // 2
    margin = (policy[:half] - reference[:half]) - (policy[half:] - reference[half:])
    loss = -F.logsigmoid(beta * margin).mean()
    return loss, (margin > 0).float().mean().item()


class _Batches:
    def __init__(self, run: TrainingRun, pad_id: int):
        self.run, self.pad_id = run, pad_id

    def make(self, examples: list[Encoded]) -> dict[str, torch.Tensor]:
        rows = _preference_rows(examples) if self.run.method == DPO else _supervised_rows(examples)
        return _pad(rows, self.pad_id, self.run.device)

    def loss(self, model: PeftModel, examples: list[Encoded]) -> tuple[torch.Tensor, float]:
        batch = self.make(examples)
        if self.run.method == DPO:
            return _dpo_loss(model, batch, self.run.hyperparameters.beta)
        return _supervised_loss(model, batch)

    def chunks(self, examples: list[Encoded]) -> Iterator[list[Encoded]]:
        size = self.run.hyperparameters.batch_size
        for start in range(0, len(examples), size):
            yield examples[start: start + size]


# -- the loop -----------------------------------------------------------------------------------------------------

def target_modules(base_config: dict) -> list[str]:
    """Every attention and MLP projection of the base's family, by the names its checkpoint has: q/k/v/o and
    gate/up/down, or Phi-3's fused qkv_proj and gate_up_proj (so the adapter is what PEFT on that model writes)."""
    return list(BaseShapes.from_config(base_config).family.projections)


def _model(run: TrainingRun) -> PeftModel:
    dtype = torch.bfloat16 if run.device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    base = AutoModelForCausalLM.from_pretrained(run.base_dir, dtype=dtype).to(run.device)
    torch.manual_seed(run.hyperparameters.seed)
    config = LoraConfig(
        r=run.hyperparameters.lora_rank, lora_alpha=run.hyperparameters.lora_alpha, lora_dropout=0.0,
        target_modules=target_modules(base.config.to_dict()), task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(base, config)


def _schedule(total: int):
    warmup = max(1, total // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


@torch.no_grad()
def _validation_loss(model: PeftModel, batches: _Batches, examples: list[Encoded]) -> float | None:
    if not examples:
        return None
    model.eval()
    examples = examples[:MAX_VALIDATION_EXAMPLES]
    total = 0.0
    for chunk in batches.chunks(examples):
        loss, _ = batches.loss(model, chunk)
        total += loss.item() * len(chunk)
    model.train()
    return total / len(examples)


def train(run: TrainingRun, progress: Progress) -> Result:
    """Trains (or resumes) the run; the PEFT adapter is saved to `work_dir/adapter` when every step is done."""
    hyper = run.hyperparameters
    total = total_steps(len(run.train), hyper)
    model = _model(run)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else (model.config.eos_token_id or 0)
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    batches = _Batches(run, pad_id)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=hyper.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(total))
    checkpoint_root = run.work_dir / "checkpoints"
    start = 0
    if (found := checkpoints.latest(checkpoint_root)) is not None and found.step <= total:
        checkpoints.restore(found, model=model, optimizer=optimizer, scheduler=scheduler)
        start = found.step
        progress.resumed(step=start)
    model.train()
    metrics = None
    for step in range(start, total):
        examples = [run.train[i] for i in batch_indices(len(run.train), hyper, step)]
        loss, accuracy = batches.loss(model, examples)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        at_checkpoint = done % run.checkpoint_every == 0 or done == total
        valid = _validation_loss(model, batches, run.validation) if at_checkpoint else None
        metrics = Metrics(step=done, total_steps=total, train_loss=loss.item(), train_mean_token_accuracy=accuracy,
                          valid_loss=valid)  # fmt: skip
        if at_checkpoint:
            saved = checkpoints.save(checkpoint_root, step=done, model=model, optimizer=optimizer, scheduler=scheduler,
                                     metrics={"train_loss": metrics.train_loss, "valid_loss": valid})  # fmt: skip
            progress.checkpoint(step=done, path=saved.path, metrics=metrics)
        if not progress.step(metrics):
            return Result(adapter_dir=None, steps=done, trained_tokens=trained_tokens(run, done))
    adapter_dir = run.work_dir / "adapter"
    model.save_pretrained(adapter_dir)
    return Result(adapter_dir=adapter_dir, steps=total, trained_tokens=trained_tokens(run, total))
