"""Adapter cold starts for benchmarks/trace_engine.py: TTFT with the adapter on disk only, in host memory only,
and warm; the filesystem the adapter files are on; one adapter's bytes copied host -> device by torch alone.

"On disk only" is made true by asking the kernel to drop the cached pages of the adapter's files
(fsync, then posix_fadvise DONTNEED) before the engine is told of it; on tmpfs there is no disk,
and the report names the filesystem.
"""

import os
import random
import statistics
import time
from pathlib import Path

import llama_shape
import torch


def cold_start(engine, plan: dict, shape, device: str, *, ttft) -> dict:
    """TTFT with the adapter on disk only / in host memory only, then warm; raw host->device copies too.
    `ttft(engine, prompt, digest, request_id)` runs one request to its first token and returns the TTFT in ms."""
    prompt_len = plan["args"]["cold_prompt"]
    rng = random.Random(7)
    out: dict = {
        "prompt_tokens": prompt_len,
        "disk": [],
        "host": [],
        "filesystem": filesystem(Path(plan["checkpoint"])),
    }
    for kind in ("disk", "host"):
        for adapter_id in plan["cold_adapters"][kind]:
            entry = plan["adapters"][str(adapter_id)]
            dropped = drop_page_cache(Path(entry["path"]))
            row = {"adapter": adapter_id, "page_cache_dropped": dropped}
            if kind == "disk":
                engine.register_adapter(entry["digest"], entry["path"])
            else:
                start = time.perf_counter()
                engine.add_adapter(entry["path"])
                row["disk_to_host_ms"] = (time.perf_counter() - start) * 1e3
            for phase in ("cold", "warm"):
                prompt = [rng.randrange(3, shape.vocab) for _ in range(prompt_len)]
                row[f"ttft_{phase}_ms"] = ttft(
                    engine, prompt, entry["digest"], f"cold-{kind}-{adapter_id}-{phase}"
                )
            out[kind].append(row)
    if device.startswith("cuda"):
        out["raw_copy_ms"] = raw_copies(llama_shape.adapter_bytes(shape, plan["args"]["rank"], 2), device)
    return out


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (tmpfs means the "disk" tier is memory), from /proc/mounts."""
    best, kind = "", "unknown"
    mounts = Path("/proc/mounts")
    for line in mounts.read_text().splitlines() if mounts.exists() else []:
        _, point, fstype = line.split()[:3]
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def drop_page_cache(directory: Path) -> bool:
    """Ask the kernel to forget the cached pages of the adapter's files, so the next read comes from disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_copies(num_bytes: int, device: str) -> dict:
    """One adapter's bytes copied host -> device by torch alone (pinned and pageable): the transfer floor."""
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    result = {}
    for kind, src in (("pinned", torch.empty(num_bytes, dtype=torch.uint8).pin_memory()),
                      ("pageable", torch.empty(num_bytes, dtype=torch.uint8))):  # fmt: skip
        src.random_(0, 255)
        times = []
        for _ in range(7):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        result[kind] = statistics.median(times[2:])
    return result
