"""A job's hyperparameters as OpenAI takes them ("auto" or a value), with Quilt's LoRA extensions, resolved once
at creation so the job records exactly what it trains with.

- n_epochs (1..50), batch_size (1..256), learning_rate_multiplier (> 0, <= 100; times the platform's base
  learning rate), and for DPO beta (> 0, <= 2).
- Quilt extensions: lora_rank (1..the platform's adapter rank limit), lora_alpha (> 0; default 2 x rank).
- "auto": a batch of ~5% of the examples (1..16), and epochs for at least AUTO_MIN_STEPS optimizer steps (1..10).
"""

import math

from django.conf import settings

from finetuning.errors import FineTuningRefusal
from training.dataset import DPO
from training.steps import steps_per_epoch

AUTO = "auto"
AUTO_MIN_STEPS = 100  # fewer updates than this leave a LoRA at the platform's base learning rate underfit
RANGES = {  # resolved in this order: n_epochs' "auto" depends on the batch size
    "batch_size": (int, 1, 256),
    "n_epochs": (int, 1, 50),
    "learning_rate_multiplier": (float, 1e-6, 100.0),
    "beta": (float, 1e-6, 2.0),
    "lora_rank": (int, 1, None),
    "lora_alpha": (float, 1e-6, 4096.0),
}


def _auto(name: str, *, examples: int, method: str, given: dict) -> int | float:
    if name == "n_epochs":  # enough passes for AUTO_MIN_STEPS optimizer steps, within 1..10
        return min(10, max(1, math.ceil(AUTO_MIN_STEPS / steps_per_epoch(examples, given["batch_size"]))))
    if name == "batch_size":
        return min(16, max(1, examples // 20))
    if name == "learning_rate_multiplier":
        return 1.0
    if name == "beta":
        return 0.1
    if name == "lora_rank":
        return settings.QUILT_FINE_TUNING_DEFAULT_RANK
    if name == "lora_alpha":
        return 2.0 * given["lora_rank"]
    raise AssertionError(name)


def _value(name: str, raw, *, param: str) -> int | float:
    kind, low, high = RANGES[name]
    if name == "lora_rank":
        high = settings.QUILT_ADAPTER_MAX_RANK
    is_number = isinstance(raw, int) or (isinstance(raw, float) and math.isfinite(raw))  # JSON lets NaN through
    if isinstance(raw, bool) or not is_number or (kind is int and isinstance(raw, float) and not raw.is_integer()):
        raise FineTuningRefusal(f"{param} must be \"auto\" or a number.", code="invalid_hyperparameter", param=param)
    if not low <= raw <= high:  # before kind(raw): an int past a float's range can't become one
        raise FineTuningRefusal(
            f"{param} must be between {low:g} and {high:g}; got {str(raw)[:20]}.", code="invalid_hyperparameter",
            param=param,
        )  # fmt: skip
    return kind(raw)


def hyperparameters_resolve(*, given: dict | None, method: str, examples: int, param: str) -> dict:
    """Every hyperparameter the method uses, "auto" replaced by its value for this many examples."""
    given = given or {}
    if not isinstance(given, dict):
        raise FineTuningRefusal(f"{param} must be an object.", code="invalid_hyperparameter", param=param)
    names = [n for n in RANGES if n != "beta" or method == DPO]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise FineTuningRefusal(
            f"Unknown hyperparameter {unknown[0]!r} for {method}; known: {', '.join(names)}.",
            code="invalid_hyperparameter", param=f"{param}.{unknown[0]}",
        )  # fmt: skip
    resolved: dict = {}
    for name in names:
        raw = given.get(name, AUTO)
        resolved[name] = (
            _auto(name, examples=examples, method=method, given=resolved) if raw in (AUTO, None)
            else _value(name, raw, param=f"{param}.{name}")
        )  # fmt: skip
    return resolved


def learning_rate(hyperparameters: dict) -> float:
    return settings.QUILT_FINE_TUNING_BASE_LEARNING_RATE * hyperparameters["learning_rate_multiplier"]
