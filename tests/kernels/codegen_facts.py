"""What the compiler makes of the quantized GEMMs at Llama-3-8B's decode shapes, with no GPU: each launch compiled for
sm_90 as the JIT specializes it (tests/kernels/compile_check.py), then ptxas -v (registers, spill stores) and the SASS
of its reduction loop (nvdisasm): the bytes one thread asks of global memory per step, by width, through loads that
bypass L1 (`.BYPASS`, each asked of L2: cp.async.cg) and loads L1 may serve, the int/float conversion
instructions, the tensor-core instructions.

Run as a script in a process where Triton is NOT in interpreter mode: `python tests/kernels/codegen_facts.py
[case ...]` prints {case: [facts of each launch]} as JSON (docs/quantization.md reads the decode shapes with it)."""

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton import knobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kernels.compile_check import _compile, _recorded_launches  # noqa: E402

SMS = 132  # an H100/H200
PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONVERSION = re.compile(r"^(I2F|F2F|F2I|I2I)")


def _wna16(tokens: int, projection: str, dtype: torch.dtype) -> list[tuple]:
    import importlib

    module = importlib.import_module("kernels.wna16_linear")
    in_dim, out_dim = PROJECTIONS[projection]
    weights = (torch.zeros(in_dim // 8, out_dim, dtype=torch.int32), torch.rand(in_dim // 128, out_dim).to(dtype),
               torch.zeros(in_dim // 128, out_dim // 8, dtype=torch.int32), (torch.arange(in_dim) // 128).int())
    config = module.plan(tokens, out_dim, in_dim, 128, 4, SMS)
    return _recorded_launches("wna16_linear", torch.randn(tokens, in_dim).to(dtype), *weights, 4, group_size=128,
                              config=config)


def _fp8(tokens: int, projection: str, dtype: torch.dtype) -> list[tuple]:
    import importlib

    module = importlib.import_module("kernels.fp8_block_linear")
    in_dim, out_dim = PROJECTIONS[projection]
    weight = torch.zeros(out_dim, in_dim).to(torch.float8_e4m3fn)
    scales = torch.rand(out_dim, in_dim // 128)
    config = module._config(tokens, out_dim, in_dim, 128, SMS)
    return _recorded_launches("fp8_block_linear", torch.randn(tokens, in_dim).to(dtype), weight, scales, 128,
                              config=config)


CASES = {
    "wna16 T=1 o bf16": lambda: _wna16(1, "o", torch.bfloat16),
    "wna16 T=64 down bf16": lambda: _wna16(64, "down", torch.bfloat16),
    "wna16 T=16 qkv fp16": lambda: _wna16(16, "qkv", torch.float16),
    "fp8_block T=64 o bf16": lambda: _fp8(64, "o", torch.bfloat16),
}


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    path = getattr(knobs.nvidia, name).path
    return subprocess.run([path, *args], capture_output=True, text=True, check=True)


def _instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """(opcodes with their operands, in order; label -> index of the next instruction)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if found:
            instructions.append(re.sub(r"^@!?U?P\w+\s+", "", found.group(1).strip()))
    return instructions, labels


def _width(opcode: str) -> int:
    """Bytes one thread moves with a global load of this opcode (LDG.E.128, LDGSTS.E.BYPASS.128, LDG.E.U16, ...)."""
    parts = set(opcode.split("."))
    return 16 if "128" in parts else 8 if "64" in parts else 2 if parts & {"U16", "S16"} else 1 if parts & {
        "U8", "S8"} else 4


def loop_facts(sass: str) -> dict:
    """The largest loop (a backward branch's body): instructions, global bytes asked per thread, opcodes."""
    instructions, labels = _instructions(sass)
    best: list[str] = []
    for index, instruction in enumerate(instructions):
        target = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", instruction)
        if target and labels.get(target.group(1), index + 1) <= index:
            body = instructions[labels[target.group(1)] : index + 1]
            best = body if len(body) > len(best) else best
    opcodes = collections.Counter(instruction.split()[0] for instruction in best)
    def loaded(bypass: bool) -> int:
        return sum(count * _width(op) for op, count in opcodes.items()
                   if op.startswith(("LDG.", "LDGSTS.")) and (".BYPASS" in op) == bypass)  # fmt: skip

    return {"instructions": len(best), "l2_bytes_per_thread": loaded(True), "l1_bytes_per_thread": loaded(False),
            "conversions": sum(c for op, c in opcodes.items() if CONVERSION.match(op)),
            "tensor_core": sum(c for op, c in opcodes.items() if op.startswith(("HMMA", "HGMMA"))),
            "opcodes": dict(opcodes.most_common(12))}  # fmt: skip


def facts(fn, args, kwargs) -> dict:
    constexprs = {k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")}
    compiled = _compile(fn, args, dict(kwargs), arch=90)
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        log = _tool("ptxas", "-v", "--gpu-name=sm_90a", ptx, "-o", cubin).stderr
        sass = _tool("nvdisasm", "-c", cubin).stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"kernel": fn.__name__, "constexprs": {k: str(v) for k, v in constexprs.items()},
            "threads": 32 * compiled.metadata.num_warps, "registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(spills.group(1)) if spills else 0, "shared": compiled.metadata.shared,
            "loop": loop_facts(sass)}  # fmt: skip


def main(names: list[str]) -> dict:
    return {name: [facts(*launch) for launch in CASES[name]()] for name in names or CASES}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print(json.dumps(main(sys.argv[1:])))
