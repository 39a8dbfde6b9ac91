"""adapter_config.json as PEFT writes it: parsed, refused where Quilt can't serve it, matched as PEFT matches.

The matching rules (target_modules, layers_to_transform, exclude_modules, rank_pattern, alpha_pattern)
mirror peft.tuners.tuners_utils.check_target_module_exists and peft.utils.other.get_pattern_key, so that
every module gets the rank and scaling PEFT itself would give it.
"""

import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from adapters.errors import AdapterError
from adapters.pattern_guard import check_pattern

MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERN_ENTRIES = 4096

# Settings that change nothing at inference, or that are checked one by one below.
_HANDLED = {
    "alpha_pattern",
    "auto_mapping",
    "base_model_name_or_path",
    "bias",
    "exclude_modules",
    "fan_in_fan_out",
    "inference_mode",
    "init_lora_weights",
    "layers_pattern",
    "layers_to_transform",
    "lora_alpha",
    "lora_dropout",
    "peft_type",
    "peft_version",
    "r",
    "rank_pattern",
    "revision",
    "target_modules",
    "task_type",
    "use_rslora",
    "use_dora",
    "modules_to_save",
    "lora_bias",
    "target_parameters",
    "trainable_token_indices",
    "megatron_core",
    "use_qalora",
    "qalora_group_size",
    "ensure_weight_tying",
    # initialisation recipes: they shape training, not the saved tensors' meaning
    "eva_config",
    "corda_config",
    "loftq_config",
    "lora_ga_config",
}
# init_lora_weights values that rewrite the base weights, so the adapter alone is not the fine-tune.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoraSettings:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: list[str] | str
    target_parameters: list[str]  # parameters adapted directly: the MoE experts' stacked weights
    layers_to_transform: list[int] | int | None
    layers_pattern: list[str] | None
    exclude_modules: list[str] | str | None
    base_model_name_or_path: str | None

    @classmethod
    def from_json(cls, raw: bytes) -> "LoraSettings":
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterError(
                "config_invalid", f"adapter_config.json is {len(raw)} bytes; the limit is {MAX_CONFIG_BYTES}"
            )
        try:
            config = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterError(
                "config_invalid_json", f"adapter_config.json is not valid JSON: {exc}"
            ) from None
        if not isinstance(config, dict):
            raise AdapterError("config_invalid", "adapter_config.json must hold a JSON object")
        return cls.from_dict(config)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "LoraSettings":
        _refuse_unservable(config)
        r = _positive_int(config.get("r", 8), "r")
        target_modules = config.get("target_modules")
        target_parameters = config.get("target_parameters") or []
        if not (isinstance(target_parameters, list) and all(isinstance(t, str) for t in target_parameters)):
            raise AdapterError("config_invalid", "target_parameters must be a list of parameter names")
        if isinstance(target_modules, str):
            check_pattern(target_modules, "target_modules")
            if config.get("layers_to_transform") is not None:
                raise AdapterError(
                    "config_invalid",
                    "layers_to_transform cannot be used when target_modules is a regex string",
                )
        elif (
            isinstance(target_modules, list)
            and (target_modules or target_parameters)
            and all(isinstance(t, str) for t in target_modules)
        ):
            pass
        else:
            raise AdapterError(
                "config_invalid",
                "adapter_config.json must name target_modules (a list of names or a regex) or target_parameters",
            )
        layers = config.get("layers_to_transform")
        if layers is not None and not (
            _is_int(layers) or (isinstance(layers, list) and all(_is_int(x) for x in layers))
        ):
            raise AdapterError(
                "config_invalid",
                f"layers_to_transform must be an integer or a list of integers, not {layers!r}",
            )
        layers_pattern = config.get("layers_pattern")
        if isinstance(layers_pattern, str):
            layers_pattern = [layers_pattern]
        if layers_pattern and layers is None:
            raise AdapterError(
                "config_invalid", "layers_pattern is only meaningful together with layers_to_transform"
            )
        if layers_pattern is not None and not (
            isinstance(layers_pattern, list) and all(isinstance(p, str) for p in layers_pattern)
        ):
            raise AdapterError("config_invalid", "layers_pattern must be a string or a list of strings")
        for pattern in layers_pattern or ():
            check_pattern(pattern, "layers_pattern")
        exclude = config.get("exclude_modules")
        if isinstance(exclude, str):
            check_pattern(exclude, "exclude_modules")
        elif exclude is not None and not (
            isinstance(exclude, list) and all(isinstance(x, str) for x in exclude)
        ):
            raise AdapterError("config_invalid", "exclude_modules must be a list of names or a regex string")
        return cls(
            r=r,
            lora_alpha=_number(config.get("lora_alpha", 8), "lora_alpha"),
            use_rslora=_flag(config.get("use_rslora", False), "use_rslora"),
            rank_pattern={
                key: _positive_int(value, f"rank_pattern[{key!r}]")
                for key, value in _pattern(config, "rank_pattern").items()
            },
            alpha_pattern={
                key: _number(value, f"alpha_pattern[{key!r}]")
                for key, value in _pattern(config, "alpha_pattern").items()
            },
            target_modules=target_modules,
            target_parameters=target_parameters,
            layers_to_transform=layers,
            layers_pattern=layers_pattern,
            exclude_modules=exclude,
            base_model_name_or_path=config.get("base_model_name_or_path")
            if isinstance(config.get("base_model_name_or_path"), str)
            else None,
        )

    def targets(self, key: str) -> bool:
        """Whether PEFT puts a LoRA on the module named `key` (check_target_module_exists)."""
        if isinstance(self.exclude_modules, str):
            if re.fullmatch(self.exclude_modules, key):
                return False
        elif self.exclude_modules and (
            key in self.exclude_modules or any(key.endswith(f".{e}") for e in self.exclude_modules)
        ):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules == "all-linear":
                return key != "lm_head" and key.rsplit(".", 1)[-1].endswith("_proj")
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:
            return True
        if not any(key.endswith(f".{target}") for target in self.target_modules):
            return False
        return self._layer_selected(key)

    def targets_parameter(self, key: str) -> bool:
        """Whether PEFT puts a LoRA on the parameter named `key` (BaseTuner's target_parameters matching: the
        name or a dotted suffix of it; layers_to_transform and exclude_modules do not apply)."""
        return key in self.target_parameters or any(key.endswith(f".{t}") for t in self.target_parameters)

    def _layer_selected(self, key: str) -> bool:
        wanted = self.layers_to_transform
        if wanted is None or wanted == []:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == wanted if isinstance(wanted, int) else index in wanted

    def rank_for(self, key: str) -> int:
        return self.rank_pattern.get(_pattern_key(self._rank_matchers, key), self.r)

    def alpha_for(self, key: str) -> float:
        return self.alpha_pattern.get(_pattern_key(self._alpha_matchers, key), self.lora_alpha)

    @cached_property
    def _rank_matchers(self) -> list[tuple[str, re.Pattern[str]]]:
        return _suffix_matchers(self.rank_pattern)

    @cached_property
    def _alpha_matchers(self) -> list[tuple[str, re.Pattern[str]]]:
        return _suffix_matchers(self.alpha_pattern)

    def scaling(self, alpha: float, rank: int) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _suffix_matchers(patterns: dict[str, Any]) -> list[tuple[str, re.Pattern[str]]]:
    """peft.utils.other.get_pattern_key's regex per pattern, compiled once (re's own cache holds 512)."""
    return [(pattern, re.compile(rf"(.*\.)?({pattern})$")) for pattern in patterns]


def _pattern_key(matchers: list[tuple[str, re.Pattern[str]]], key: str) -> str:
    """get_pattern_key: the first pattern that matches a dotted suffix of `key`, else `key` itself."""
    for pattern, matcher in matchers:
        if matcher.match(key):
            return pattern
    return key


def _refuse_unservable(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            "not_lora", f"adapter_config.json has peft_type {peft_type!r}; only LORA adapters are served"
        )
    task_type = config.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        raise AdapterError(
            "unsupported_task",
            f"adapter_config.json has task_type {task_type!r}; Quilt serves causal language models (CAUSAL_LM)",
        )
    if config.get("use_dora"):
        raise AdapterError(
            "dora_unsupported", "DoRA adapters (use_dora) are not served yet; train with use_dora=False"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            "modules_to_save_unsupported",
            f"modules_to_save ({config['modules_to_save']}) fully retrains base modules; that is not served yet",
        )
    if config.get("trainable_token_indices"):
        raise AdapterError(
            "embedding_unsupported", "trainable_token_indices changes the embeddings; that is not served yet"
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError(
            "fan_in_fan_out_unsupported",
            "fan_in_fan_out=True is for GPT-2 style Conv1D layers; Llama, Mistral and Qwen2 use nn.Linear, so it must be false",
        )
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(
            "bias_unsupported", "adapters that train biases (bias != 'none' or lora_bias) are not served yet"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            "unsupported_option",
            f"init_lora_weights={init!r} also rewrites the base weights; convert it to a plain LoRA when saving "
            "(save_pretrained(..., path_initial_model_for_weight_conversion=...))",
        )
    if config.get("use_qalora"):
        raise AdapterError("unsupported_option", "QA-LoRA adapters (use_qalora) are not served")
    for key, value in config.items():
        if key in _HANDLED or value in (None, False, {}, [], ""):
            continue
        raise AdapterError(
            "unsupported_option", f"adapter_config.json sets {key}={value!r}, which Quilt does not serve"
        )


def _pattern(config: dict[str, Any], field: str) -> dict[str, Any]:
    value = config.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterError(
            "config_invalid", f"{field} must be a JSON object mapping module patterns to values"
        )
    if len(value) > MAX_PATTERN_ENTRIES:
        raise AdapterError(
            "config_invalid", f"{field} has {len(value)} entries; the limit is {MAX_PATTERN_ENTRIES}"
        )
    for key in value:
        check_pattern(key, field)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, field: str) -> int:
    if not _is_int(value) or value <= 0:
        raise AdapterError("config_invalid", f"{field} must be a positive integer, not {value!r}")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterError("config_invalid", f"{field} must be a finite number, not {value!r}")
    return float(value)


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise AdapterError("config_invalid", f"{field} must be true or false, not {value!r}")
    return value
