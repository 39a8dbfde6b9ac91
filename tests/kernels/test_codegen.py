"""The quantized GEMMs' compiled code at Llama-3-8B's decode shapes (sm_90, as the JIT specializes them; no GPU):
each tile's bytes asked of L2 once per step, no int-to-float conversion per 4-bit weight in half precision, no
spills. A tile that loads a packed word for each value in it asks L2 for it 8 times at 4 bits, and a conversion
through float32 converts each weight twice: tests/kernels/codegen_facts.py prints what these tests read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("codegen_facts.py")
ITEMSIZE = {"bf16": 2, "fp16": 2}


@pytest.fixture(scope="module")
def facts() -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main(facts, case) -> tuple[dict, dict]:
    launch = facts[case][0]  # the GEMM; a split-K launch's sum follows it
    return launch, {k: int(v) if v.isdigit() else v for k, v in launch["constexprs"].items()}


@pytest.mark.parametrize("case", ["wna16 T=1 o bf16", "wna16 T=64 down bf16", "wna16 T=16 qkv fp16"])
def test_wna16_asks_l2_for_each_tile_once_and_converts_no_weight(facts, case):
    launch, c = _main(facts, case)
    words = c["BLOCK_K"] // (32 // c["BITS"]) * c["BLOCK_N"] * 4
    x_tile = c["BLOCK_M"] * c["BLOCK_K"] * ITEMSIZE[case.split()[-1]]
    assert launch["loop"]["l2_bytes_per_thread"] * launch["threads"] == words + x_tile, launch["loop"]
    assert launch["loop"]["conversions"] == 0, launch["loop"]["opcodes"]
    assert launch["spill_stores"] == 0


def test_fp8_block_asks_l2_for_each_tile_once(facts):
    launch, c = _main(facts, "fp8_block T=64 o bf16")
    weights, x_tile = c["BLOCK_K"] * c["BLOCK_N"], c["BLOCK_M"] * c["BLOCK_K"] * 2
    assert launch["loop"]["l2_bytes_per_thread"] * launch["threads"] == weights + x_tile, launch["loop"]
    assert x_tile <= weights
    assert launch["spill_stores"] == 0


def test_every_launch_fits_its_registers(facts):
    for case, launches in facts.items():
        for launch in launches:
            assert launch["spill_stores"] == 0 and launch["registers"] <= 255, (case, launch["kernel"])
