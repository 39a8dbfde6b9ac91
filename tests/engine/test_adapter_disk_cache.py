"""The disk cache of downloaded adapters: a byte bound that reservations and entries never pass together, LRU
eviction, and a start that keeps complete entries and drops what a crash left half-written."""

import pytest

from engine.server.adapter_disk_cache import AdapterDiskCache, CacheFull
from engine.server.protocol import BadRequest, parse_adapter

MARKER = "quilt_adapter.json"
DIGEST = "ab" * 32


def stage(cache: AdapterDiskCache, size: int):
    cache.reserve(size)
    staged = cache.staging()
    (staged / MARKER).write_bytes(b"x" * size)
    return staged


def on_disk(cache: AdapterDiskCache) -> int:
    return sum(p.stat().st_size for p in cache.root.rglob("*") if p.is_file())


def test_reservations_and_entries_never_pass_the_bound_and_the_least_recently_used_goes_first(tmp_path):
    evicted = []
    cache = AdapterDiskCache(tmp_path, max_bytes=100, complete_marker=MARKER, on_evict=evicted.append)
    for name in "abc":
        cache.commit(name, stage(cache, 30), reserved=30)
    assert cache.get("a") is not None  # "b" is now the least recently used
    staged = stage(cache, 30)  # 90 + 30 > 100: "b" goes before a byte is written
    assert evicted == ["b"] and cache.used_bytes == 90 and on_disk(cache) <= 100
    with pytest.raises(CacheFull):
        cache.reserve(71)  # 30 are held by the download in flight: the rest cannot hold 71
    cache.commit("d", staged, reserved=30)
    assert cache.used_bytes == on_disk(cache) == 90
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c", "d"]
    with pytest.raises(CacheFull):
        cache.reserve(101)
    assert cache.used_bytes == 90, "a refused reservation evicts nothing"


def test_a_restart_keeps_complete_entries_within_the_bound_and_drops_partial_downloads(tmp_path):
    cache = AdapterDiskCache(tmp_path, max_bytes=100, complete_marker=MARKER)
    for name in "ab":
        cache.commit(name, stage(cache, 40), reserved=40)
    cache.staging()  # a download the crash cut off
    (tmp_path / "c").mkdir()  # a folder without its sidecar
    again = AdapterDiskCache(tmp_path, max_bytes=50, complete_marker=MARKER)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"] and again.used_bytes == 40
    assert again.get("b") == tmp_path / "b" and "a" not in again


@pytest.mark.parametrize("urls,message", [
    ({"quilt_adapter.json": "https://s3/x"}, "must map"),
    ({"quilt_adapter.json": "file:///etc/passwd", "adapter_model.safetensors": "https://s3/y"}, "must map"),
    ("https://s3/x", "must map"),
], ids=["a-file-missing", "not-http", "not-an-object"])
def test_adapter_urls_name_each_canonical_file_by_an_http_url(urls, message):
    with pytest.raises(BadRequest, match=message):
        parse_adapter({"digest": DIGEST, "urls": urls})
    with pytest.raises(BadRequest, match="not both"):
        parse_adapter({"digest": DIGEST, "path": "/x", "urls": {"quilt_adapter.json": "https://s3/x",
                                                                 "adapter_model.safetensors": "https://s3/y"}})
