"""Kernel tests: without CUDA the Triton kernels run in Triton's CPU interpreter on CPU tensors;
with CUDA the same tests run natively (and the float16/bfloat16 cases marked `gpu` run too)."""

import importlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    from kernels import interpreter

    interpreter.enable(route_ops=False)  # these tests call launchers and references themselves


def load_triton_op(name: str):
    """The Triton launcher `name` from kernels/<name>.py (the dispatch would send CPU tensors to the reference)."""
    return getattr(importlib.import_module(f"kernels.{name}"), name)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
