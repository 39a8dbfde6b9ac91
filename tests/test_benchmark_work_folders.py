"""The GPU suite's benchmarks leave no work folder behind (benchmarks/work_folder.py): not when they finish, not when
gpu_suite.sh's `timeout -s INT` stops them. On the GPU machine quantized_checkpoints.py left its 8B-shaped
checkpoints in /tmp (22 GB for w4a16, 25 GB for fp8ckpt) and the next step, gpu_trace.py, failed with ENOSPC."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.work_folder import work_folder  # noqa: E402

# each benchmark the suite runs that writes a work folder, on its tiny CPU shape, as few steps as it takes
BENCHMARKS = {
    "quantized_checkpoints": ["benchmarks/quantized_checkpoints.py", "--suite", "w4a16", "--shape", "llama-tiny",
                              "--rounds", "1", "--batches", "2", "--adapters", "2"],
    "quantization": ["benchmarks/quantization.py", "--shape", "llama-tiny", "--tokens", "16", "--batch", "2",
                     "--rounds", "1", "--decode-steps", "2", "--configs", "int8"],
    "gpu_precision": ["benchmarks/gpu_precision.py", "--tiny", "--prompts", "2", "--tokens", "2"],
    "gpu_trace": ["benchmarks/gpu_trace.py", "--tiny", "--requests", "4", "--peft-seconds", "2", "--decode-steps", "2",
                  "--cold", "1"],
}


def _start(args: list[str], temp: Path, **popen) -> subprocess.Popen:
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def _ours(temp: Path) -> list[str]:
    return sorted(p.name for p in temp.iterdir() if p.name.startswith("quilt-"))


def _wait_for_a_work_folder(process: subprocess.Popen, temp: Path, timeout: float = 120) -> None:
    """Until a quilt-* folder in `temp` has something written in it (the benchmark is at work)."""
    deadline = time.monotonic() + timeout
    while not any(any(temp.joinpath(name).iterdir()) for name in _ours(temp)):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no work folder appeared"
        time.sleep(0.05)


def test_the_work_folder_goes_when_the_block_ends_or_fails(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with work_folder("quilt-test-") as folder:
        (folder / "checkpoint").write_text("weights")
    assert not folder.exists()
    with pytest.raises(RuntimeError), work_folder("quilt-test-") as folder:
        (folder / "checkpoint").write_text("weights")
        raise RuntimeError("a benchmark failed")
    assert not folder.exists()
    given = tmp_path / "given"
    with work_folder("quilt-test-", path=given) as folder:  # the caller's own folder (--workdir) stays
        (folder / "checkpoint").write_text("weights")
    with work_folder("quilt-test-", keep=True) as kept:  # --keep
        pass
    assert folder == given and given.exists() and kept.exists()


SLEEPER = ("import sys, time; from benchmarks.work_folder import work_folder\n"
           "with work_folder('quilt-test-') as folder:\n"
           "    (folder / 'checkpoint').write_text('weights')\n"
           "    time.sleep(120)\n")


@pytest.mark.parametrize(("signum", "ignored_at_start"), [(signal.SIGINT, False), (signal.SIGINT, True),
                                                          (signal.SIGTERM, False)],
                         ids=["sigint", "sigint-ignored-at-start", "sigterm"])
def test_the_work_folder_goes_when_the_process_is_signalled(tmp_path, signum, ignored_at_start):
    """SIGINT as `timeout -s INT` sends it, also to a process that started with SIGINT ignored (sent to the
    background by a shell without job control: Python then installs no KeyboardInterrupt), and SIGTERM."""
    temp = tmp_path / "tmp"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored_at_start else None
    process = _start(["-c", SLEEPER], temp, preexec_fn=ignore)
    _wait_for_a_work_folder(process, temp)
    process.send_signal(signum)
    assert process.wait(timeout=30) != 0
    assert _ours(temp) == []


# a thread that goes on writing in the folder after the main thread was interrupted, as a thread pool's worker does
# when SIGINT comes while the pool starts it (gpu_trace.py in llama_shape.write_adapters: the folder was left)
WRITER = ("import threading, time; from benchmarks.work_folder import work_folder\n"
          "with work_folder('quilt-test-') as folder:\n"
          "    def write():\n"
          "        for i in range(40):\n"
          "            (folder / f'adapter-{i}').mkdir(parents=True, exist_ok=True)\n"
          "            time.sleep(0.02)\n"
          "    threading.Thread(target=write).start()\n"
          "    (folder / 'checkpoint').write_text('weights')\n"
          "    time.sleep(120)\n")


def test_a_thread_still_writing_when_the_process_is_signalled_leaves_no_folder(tmp_path):
    temp = tmp_path / "tmp"
    process = _start(["-c", WRITER], temp)
    _wait_for_a_work_folder(process, temp)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) != 0
    assert _ours(temp) == []


def test_a_writer_that_ends_during_the_removal_leaves_no_folder(tmp_path, monkeypatch):
    """A pool's worker writes once more just after the first removal and ends before the writers are counted (as
    quantization.py's write_adapters did under load): the folder is still removed."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    remove = shutil.rmtree
    last_write = []

    def removal_then_a_last_write(path, **kwargs):
        remove(path, **kwargs)
        if not last_write:
            last_write.append(Path(path) / "adapter-3")
            last_write[0].mkdir(parents=True)

    monkeypatch.setattr(shutil, "rmtree", removal_then_a_last_write)
    with pytest.raises(KeyboardInterrupt), work_folder("quilt-test-") as folder:
        raise KeyboardInterrupt
    assert last_write and not folder.exists()


@pytest.mark.parametrize("name", ["quantized_checkpoints", "quantization"])
def test_a_finished_benchmark_leaves_no_work_folder(tmp_path, name):
    temp = tmp_path / "tmp"
    process = _start(BENCHMARKS[name], temp)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert _ours(temp) == []


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_an_interrupted_benchmark_leaves_no_work_folder(tmp_path, name):
    """Interrupted as gpu_suite.sh's limit interrupts a step: SIGINT while it writes its checkpoint."""
    temp = tmp_path / "tmp"
    process = _start(BENCHMARKS[name], temp)
    _wait_for_a_work_folder(process, temp)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0, output
    assert _ours(temp) == [], output
