"""Kernel launches of one decode step of a small Llama, every op on its Triton launcher, counted on CPU
(benchmarks/decode_launches.py: tensors on the meta device, Triton launches counted, not run). LoRA's share is
one launch per adapted projection group (qkv, o, gate_up, down), built from metadata the step fills once."""

import pytest

from benchmarks.decode_launches import measure

SHAPE = {"num_layers": 3, "hidden": 64, "batch": 8, "rank": 8, "context": 40, "steps": 1}


@pytest.fixture(scope="module")
def counts():
    return {adapters: measure(adapters=adapters, **SHAPE) for adapters in (0, 5)}


def test_lora_adds_one_launch_per_projection_group_per_layer(counts):
    base, lora = counts[0], counts[5]
    assert lora["per_layer"] - base["per_layer"] == 4
    assert base["per_layer"] <= 11  # rms_norm x2, 4 linears, rotary, store_kv, attention, silu_and_mul, o's reshape


def test_the_step_metadata_is_a_few_launches_and_no_host_sync(counts):
    base, lora = counts[0], counts[5]
    outside = sum(lora["counts"]["outside"].values()) - sum(base["counts"]["outside"].values())
    assert outside <= 2  # the LoRA metadata of the step: one copy of the grouping (and the tokens' slots)
    assert lora["counts"]["syncs"] == base["counts"]["syncs"] == 0
