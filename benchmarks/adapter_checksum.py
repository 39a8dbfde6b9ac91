"""What checking a stored adapter on every read costs: the weights file of an 84 MB adapter (rank 16, bf16, all seven
projections of 32 hidden-4096 layers: Llama-3-8B's shape) read into memory the way the engine reads it, with and
without its xxh3 checksum, side by side in one process.

    python benchmarks/adapter_checksum.py               # 3 runs, page cache warm and dropped
    python benchmarks/adapter_checksum.py --runs 5 --json out.json

off     adapters.safetensors_check.read_tensors(weights): the one read, nothing checked
xxh3    the same read with the sidecar's checksum, each block hashed right after it is read (what a load does)
sha256  the read, then the content digest recomputed (what a load of a sidecar without checksums does)
hash    the hashes alone over the file's bytes already in memory (the floor each adds to a read)
"cached" reads from the page cache (the checksum's largest share); "dropped" asks the kernel to forget the file's
pages first (posix_fadvise DONTNEED; a tmpfs keeps them: the filesystem is printed). The three are interleaved within
each run, so a drift of the machine's load falls on all; each figure is the median of --runs with the min-max spread,
and each ratio is taken run by run.
"""

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/

import llama_shape  # noqa: E402
import trace_cold  # noqa: E402

from adapters import checksum  # noqa: E402
from adapters.layout import WEIGHTS_NAME  # noqa: E402
from adapters.loaded import CHECKSUMS, SIDECAR_NAME, adapter_digest  # noqa: E402
from adapters.safetensors_check import read_tensors  # noqa: E402

KINDS = ("off", "xxh3", "sha256")


def spread(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):8.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def read(weights: Path, kind: str, checksum: str) -> None:
    tensors = read_tensors(weights, checksum=checksum if kind == "xxh3" else None)
    if kind == "sha256":
        adapter_digest(tensors, {})


def hash_only(weights: Path, *, runs: int) -> dict[str, list[float]]:
    data = weights.read_bytes()
    times: dict[str, list[float]] = {"xxh3": [], "sha256": []}
    for _ in range(runs):
        for kind, hash_of in (("xxh3", checksum.of_bytes), ("sha256", lambda b: hashlib.sha256(b).hexdigest())):
            start = time.perf_counter()
            hash_of(data)
            times[kind].append((time.perf_counter() - start) * 1e3)
    return times


def measure(path: Path, *, runs: int, drop: bool) -> dict[str, list[float]]:
    weights = path / WEIGHTS_NAME
    checksum = json.loads((path / SIDECAR_NAME).read_text())[CHECKSUMS]["files"][WEIGHTS_NAME]
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    read(weights, "off", checksum)  # first touch: allocator, page cache
    for _ in range(runs):
        for kind in KINDS:
            if drop:
                trace_cold.drop_page_cache(path)
            start = time.perf_counter()
            read(weights, kind, checksum)
            times[kind].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs: at least 3")
    torch.set_num_threads(1)
    result: dict = {"runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="quilt-checksum-") as tmp:
        root = Path(tmp)
        adapter = llama_shape.build_adapter(llama_shape.LLAMA3_8B, rank=16, seed=1, dtype=torch.bfloat16, device="cpu")
        path = adapter.save(root / "adapter-8b")
        del adapter
        size = (path / WEIGHTS_NAME).stat().st_size
        result |= {"bytes": size, "filesystem": trace_cold.filesystem(root)}
        print(f"## adapter_checksum: {size / 1e6:.1f} MB weights file on {result['filesystem']}; "
              f"median (min-max) of {args.runs} runs")
        for mode, drop in (("cached", False), ("dropped", True)):
            times = result[mode] = measure(path, runs=args.runs, drop=drop)
            print(f"{mode}:")
            for kind in KINDS:
                rates = [size / 1e6 / ms for ms in times[kind]]  # MB/ms = GB/s
                print(f"  {kind:7} {spread(times[kind], ' ms')}  {statistics.median(rates):5.2f} GB/s")
            for kind in KINDS[1:]:
                ratios = [t / off for t, off in zip(times[kind], times["off"], strict=True)]
                print(f"  {kind} / off {spread(ratios, 'x')}")
        hashes = result["hash"] = hash_only(path / WEIGHTS_NAME, runs=args.runs)
        print("hash only (bytes in memory):")
        for kind, times in hashes.items():
            print(f"  {kind:7} {spread(times, ' ms')}  {statistics.median([size / 1e6 / ms for ms in times]):5.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
