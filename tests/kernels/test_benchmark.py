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
    for candidate in ("| plan |", "| plan for unaligned rows |", "| 5d42326 |", "best down T=4 adapters=2 r=8: "):
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
