"""A scratch temp dir that must be empty after every test, and the tiny base configs."""

import tempfile
from pathlib import Path

import pytest

from tests.adapters.builders import llama_config


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch) -> Path:
    """Every temporary directory the code under test makes lands here, and nothing may remain."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield scratch
    assert list(scratch.iterdir()) == [], "load_adapter left files behind"


@pytest.fixture
def llama_base() -> dict:
    return llama_config().to_dict()
