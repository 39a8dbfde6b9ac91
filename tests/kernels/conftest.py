"""Kernel tests: without CUDA the Triton kernels run in Triton's CPU interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here before the kernel modules
are imported; modules already imported by earlier tests are reloaded in interpreter mode.
"""

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from kernels import interpreter

    interpreter.enable()


def load_triton_op(name: str):
    """The Triton launcher `name` from kernels/<name>.py, built for this machine (native or interpreted)."""
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(f"kernels.{name}")
    if not HAS_CUDA and any(isinstance(value, JITFunction) for value in vars(module).values()):
        module = importlib.reload(module)
    return getattr(module, name)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
