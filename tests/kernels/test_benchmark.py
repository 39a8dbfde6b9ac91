"""benchmarks/kernels.py runs: its smoke mode (tiny shapes, interpreter) and its no-GPU message."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_smoke_mode_checks_triton_against_the_baselines():
    done = _run("--smoke", "--only", "silu", "store_kv", "rms_norm")
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("silu_and_mul", "store_kv", "rms_norm+residual"):
        assert f"| {op} |" in done.stdout
    assert "| NO |" not in done.stdout


def test_smoke_mode_runs_lora_through_page_tables():
    done = _run("--smoke", "--only", "lora")
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("lora_delta", "lora_shrink", "lora_expand"):
        assert f"| {op} |" in done.stdout
    assert "| NO |" not in done.stdout


def test_smoke_mode_times_lora_delta_configurations_side_by_side(tmp_path):
    done = _run("--smoke", "--only", "lora_delta_configs", "--json", str(tmp_path / "rows.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    for candidate in ("| plan |", "| plan for unaligned rows |", "| fixed |", "best down T=4 adapters=2 r=8: "):
        assert candidate in done.stdout
    assert "| NO |" not in done.stdout
    assert '"op": "lora_delta_config"' in (tmp_path / "rows.json").read_text()


def test_smoke_mode_runs_the_experts():
    done = _run("--smoke", "--only", "moe")
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("grouped_matmul gate_up", "grouped_matmul down", "expert_lora gate_up"):
        assert f"| {op} |" in done.stdout
    assert "| NO |" not in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_without_gpu_it_says_a_gpu_is_needed():
    done = _run()
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


def test_window_cpu_benchmark_runs(capsys):
    from benchmarks import window_cpu

    assert window_cpu.main(["--context", "96", "--window", "16", "--batch", "2", "--chunk", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| decode B=2 |" in out and "| prefill chunk=8 |" in out


def test_smoke_mode_times_the_quantized_gemms_against_bf16(tmp_path):
    done = _run("--smoke", "--only", "wna16", "fp8_block", "--json", str(tmp_path / "rows.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("| wna16 | o T=1 | plan |", "| wna16 | o T=1 | fixed tiles |", "| fp8_block | o T=5 | plan |",
                 "| fp8_block | o T=5 | occupancy rule |", "best wna16 down T=5: ", "best fp8_block o T=5: "):
        assert line in done.stdout
    assert "| NO |" not in done.stdout
    assert '"op": "wna16 config"' in (tmp_path / "rows.json").read_text()


def test_the_suites_default_limits_add_up_to_550_s_and_the_kernel_parts_to_their_step():
    """benchmarks/gpu_suite.sh: the default steps' limits (docs/gpu.md: one device call of about 9 minutes) and the
    kernels step's parts, in percent of its limit."""
    import re

    suite = (SCRIPT.parent / "gpu_suite.sh").read_text()
    limit = {name: int(value) for name, value in re.findall(r'^(\w+)_S="\$\{QUILT_GPU_\w+_S:-(\d+)\}"', suite, re.M)}
    env, wheels = map(int, re.search(r"^ENV_S=(\d+) WHEELS_S=(\d+)", suite, re.M).groups())
    merge = int(re.search(r"run_step kernels \$\(\(KERNELS_S \+ (\d+)\)\)", suite).group(1))
    total = 2 * wheels + env + limit["PYTEST"] + limit["PRECISION"] + limit["KERNELS"] + merge + limit["TRACE"]
    assert total <= 550, total
    parts = re.search(r'for part in ((?:"[^"]+" ?\\?\s*)+); do', suite).group(1)
    assert sum(int(p.rsplit(":", 1)[1]) for p in re.findall(r'"([^"]+)"', parts)) <= 100
    assert '"wna16 fp8_block:' in parts
