"""Damaged inputs of every kind end in a load or an AdapterError, never in another exception."""

import json
import random

import pytest

from adapters import AdapterError, load_adapter
from tests.adapters.builders import lora_config, make_tar, make_zip, tar_file, valid_files, write_adapter

ODD_VALUES = [None, 0, -1, 1.5, float("nan"), "x", "", [], {}, [1], ["q_proj"], {"a": 1}, True, False]


def load_or_refuse(source, base_config) -> str:
    try:
        load_adapter(source, base_config)
    except AdapterError as refused:
        return refused.code
    return "loaded"


def test_flipped_bytes_in_the_safetensors_header(tmp_path, llama_base):
    weights = valid_files()["adapter_model.safetensors"]
    header_end = 8 + int.from_bytes(weights[:8], "little")
    rng = random.Random(0)
    outcomes = set()
    for trial in range(120):
        damaged = bytearray(weights)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(header_end)] = rng.randrange(256)
        outcomes.add(
            load_or_refuse(write_adapter(tmp_path / f"t{trial}", raw_weights=bytes(damaged)), llama_base)
        )
    assert len(outcomes) > 2  # the damage reached several different checks


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_truncated_and_flipped_archives(tmp_path, llama_base, kind):
    files = valid_files()
    if kind == "zip":
        whole = make_zip(tmp_path / "whole", list(files.items())).read_bytes()
    else:
        whole = make_tar(
            tmp_path / "whole", [(tar_file(name), data) for name, data in files.items()]
        ).read_bytes()
    rng = random.Random(1)
    for trial in range(60):
        damaged = bytearray(whole[: rng.randrange(1, len(whole))] if trial % 2 else whole)
        if trial % 2 == 0:
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        path = tmp_path / f"upload{trial}"
        path.write_bytes(bytes(damaged))
        load_or_refuse(path, llama_base)


def test_every_config_field_with_odd_values(tmp_path, llama_base):
    base = lora_config(
        rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 2}, layers_to_transform=None, use_rslora=False
    )
    trial = 0
    for key in base:
        for value in ODD_VALUES:
            config = dict(base, **{key: value})
            raw = json.dumps(config).encode()
            trial += 1
            load_or_refuse(write_adapter(tmp_path / f"c{trial}", raw_config=raw), llama_base)


def test_pattern_matching_has_an_overall_deadline(tmp_path, llama_base, monkeypatch):
    monkeypatch.setattr("adapters.loader.PATTERN_SECONDS", -1.0)  # already past it: the first check refuses
    with pytest.raises(AdapterError) as refused:
        load_adapter(write_adapter(tmp_path / "a"), llama_base)
    assert refused.value.code == "config_too_complex" and "too long" in refused.value.message
