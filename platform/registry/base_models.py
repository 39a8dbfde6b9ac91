"""Registering base checkpoints: only what the engine can serve (a served family, safetensors, a tokenizer)."""

import json
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import transaction

from adapters.base_shapes import FAMILIES
from registry.models import Adapter, BaseModel
from tenancy.audit import Actor, audit_record

SERVED_ARCHITECTURES = {family.architecture: model_type for model_type, family in FAMILIES.items()}
REQUIRED_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    "max_position_embeddings",
)  # fmt: skip


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ValidationError(f"{directory} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValidationError(f"{path} is not a JSON object")
    return config


def language_config(config: dict) -> dict:
    """The language model's fields: a vision-language model's text_config (transformers 5 nests them there) over
    its top-level ones."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def servable_architecture(config: dict) -> str:
    """The config's architecture if the engine serves it; else a ValidationError saying what is wrong."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise ValidationError(f"config.json must name one architecture, found {architectures!r}")
    architecture = architectures[0]
    if architecture not in SERVED_ARCHITECTURES:
        raise ValidationError(
            f"architecture {architecture!r} is not served; supported: {', '.join(SERVED_ARCHITECTURES)}"
        )
    if model_type != SERVED_ARCHITECTURES[architecture]:
        raise ValidationError(f"model_type {model_type!r} does not match architecture {architecture}")
    config = language_config(config)
    for field in REQUIRED_FIELDS:
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValidationError(f"config.json field {field!r} is {value!r}, expected a positive integer")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ValidationError(f"{heads} attention heads cannot share {kv_heads!r} key/value heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not isinstance(head_dim, int) or head_dim % 2:
        raise ValidationError(f"head_dim {head_dim!r} must be an even integer for rotary embeddings")
    return architecture


def _check_files(directory: Path) -> None:
    if not any(directory.glob("*.safetensors")):
        raise ValidationError(f"{directory} has no *.safetensors weights (pickle checkpoints are not loaded)")
    if not (directory / "tokenizer.json").is_file():
        raise ValidationError(f"{directory} has no tokenizer.json")


def base_model_register(
    *, actor: Actor, name: str, checkpoint_dir: str | Path, max_context: int | None = None
) -> BaseModel:
    """Registers a checkpoint under `name`, or re-reads the config of one already registered there."""
    directory = Path(checkpoint_dir).resolve()
    if not directory.is_dir():
        raise ValidationError(f"{directory} is not a directory")
    config = _read_config(directory)
    architecture = servable_architecture(config)
    _check_files(directory)
    limit = language_config(config)["max_position_embeddings"]
    context = max_context or limit
    if not 0 < context <= limit:
        raise ValidationError(f"max context must be between 1 and the model's {limit} positions")
    fields = {
        "checkpoint_dir": str(directory), "architecture": architecture, "config": config, "max_context": context,
        "status": BaseModel.Status.ACTIVE,
    }  # fmt: skip
    with transaction.atomic():
        existing = BaseModel.objects.select_for_update().filter(name=name).first()
        if existing is None and Adapter.objects.filter(name=name, deleted_at__isnull=True).exists():
            raise ValidationError(f"A tenant's adapter is named {name!r}; a base model of that name would hide it")
        before = _snapshot(existing) if existing else None
        model = existing or BaseModel(name=name)
        for field, value in fields.items():
            setattr(model, field, value)
        model.full_clean()
        model.save()
        audit_record(
            actor=actor, action="base_model.update" if existing else "base_model.register", target=model,
            tenant=None, before=before, after=_snapshot(model),
        )  # fmt: skip
    return model


def _snapshot(model: BaseModel) -> dict:
    return {
        "name": model.name, "checkpoint_dir": model.checkpoint_dir, "architecture": model.architecture,
        "max_context": model.max_context, "status": model.status,
    }  # fmt: skip
