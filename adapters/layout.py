"""Where in an unpacked upload the adapter's two files are, and what must not be there."""

from dataclasses import dataclass
from pathlib import Path

from adapters.errors import AdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_DEPTH = 3


@dataclass(frozen=True)
class AdapterFiles:
    config: Path
    weights: Path


def find_adapter_files(root: Path) -> AdapterFiles:
    """Locate adapter_config.json (at the top, or in the one folder an archive wraps it in) and its weights."""
    files = [path for path in _walk(root, depth=0) if path.is_file()]
    pickles = sorted(str(path.relative_to(root)) for path in files if path.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterError(
            "pickle_file",
            f"the upload contains {', '.join(pickles)}: pickle files can run code when loaded, so Quilt refuses them. "
            "Save the adapter with safetensors (save_pretrained's default) and upload only its folder",
        )
    configs = sorted((path for path in files if path.name == CONFIG_NAME), key=lambda p: len(p.parts))
    if not configs and any(path.name == "config.json" for path in files):
        raise AdapterError(
            "config_missing",
            f"this looks like a full model (config.json), not a LoRA adapter: no {CONFIG_NAME} found",
        )
    if not configs:
        raise AdapterError(
            "config_missing", f"no {CONFIG_NAME} found; upload the folder PEFT's save_pretrained wrote"
        )
    top = configs[0]
    if len(configs) > 1 and len(configs[1].parts) == len(top.parts):
        raise AdapterError(
            "multiple_adapters",
            f"the upload holds several adapters ({', '.join(str(c.parent.relative_to(root)) for c in configs)}); upload one",
        )
    weights = top.parent / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError("weights_missing", f"{CONFIG_NAME} found but no {WEIGHTS_NAME} beside it")
    return AdapterFiles(config=top, weights=weights)


def _walk(directory: Path, *, depth: int) -> list[Path]:
    found = []
    for path in sorted(directory.iterdir()):
        found.append(path)
        if path.is_dir() and depth < _MAX_DEPTH:
            found.extend(_walk(path, depth=depth + 1))
    return found
