"""The adapter format: read, validate and convert PEFT LoRA adapters (no Django, no GPU)."""

from adapters.archive import ArchiveLimits
from adapters.base_shapes import BaseShapes
from adapters.errors import AdapterError
from adapters.loaded import LoadedAdapter, load_canonical
from adapters.loader import load_adapter

__all__ = ["AdapterError", "ArchiveLimits", "BaseShapes", "LoadedAdapter", "load_adapter", "load_canonical"]
