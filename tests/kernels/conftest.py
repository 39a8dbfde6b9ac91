"""Kernel tests: on a machine without CUDA the Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here before the Triton
modules are (re)loaded; modules imported earlier by other tests are reloaded in interpreter mode.
"""

import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

TRITON_MODULES = (
    "kernels.lora_shrink",
    "kernels.lora_expand",
    "kernels.store_kv",
    "kernels.paged_attention_decode",
    "kernels.paged_attention_prefill",
    "kernels.rms_norm",
    "kernels.rotary_embedding",
    "kernels.silu_and_mul",
)


def load_triton_op(name: str):
    """The Triton launcher `name` from kernels/<name>.py, built for this machine's mode."""
    module_name = f"kernels.{name}"
    module = sys.modules.get(module_name)
    if module is None:
        module = importlib.import_module(module_name)
    elif not HAS_CUDA and not getattr(module, "_interpreted", False):
        module = importlib.reload(module)
    module._interpreted = not HAS_CUDA
    return getattr(module, name)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
