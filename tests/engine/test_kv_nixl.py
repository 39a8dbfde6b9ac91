"""engine/kv/nixl.py on two real NIXL agents in one process (UCX on host memory): a source writes pages of its pool
into a puller's landing slots, and the puller gets those exact bytes under their sums; fp8 pages move with their
scales; a mixed-up page fails its sum; a puller of another layout is written nothing; slots of a failed pull rest;
a source keeps only its most recent pullers loaded."""

import asyncio

import pytest
import torch

from engine.kv.nixl import NixlEndpoint, NixlError
from engine.kv.payload import block_sums, read_pages
from engine.paged_memory import PagedMemory

pytest.importorskip("nixl_cu12")


def pool(*, pages: int = 12, kv_dtype=None, heads: int = 2, seed: int = 0) -> PagedMemory:
    memory = PagedMemory(num_layers=3, num_pages=pages, block_size=4, kv_heads=heads, head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"), kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(seed)
    for layer in memory.layers:
        layer.view(torch.uint8)[:, :pages].copy_(torch.randint(0, 256, layer.view(torch.uint8)[:, :pages].shape,
                                                              generator=generator, dtype=torch.uint8))
    for scales in memory.scales or []:
        scales[:, :pages].copy_(torch.rand(scales[:, :pages].shape, generator=generator))
    return memory


@pytest.fixture
def endpoint():
    """NixlEndpoint(memory, name=..., ...), each closed after the test."""
    made = []

    def make(memory: PagedMemory, name: str, **kwargs) -> NixlEndpoint:
        made.append(NixlEndpoint(memory, name=name, **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def push(source: NixlEndpoint, puller: NixlEndpoint, pages: list[int], slots: list[int], **kwargs) -> list[int]:
    target = puller.target(slots)
    local, remote = source.descriptors(pages, target, **kwargs)

    async def write() -> None:
        async with puller.progressing():  # the puller drives its agent while the source writes, as a decode hop does
            await source.write(local, remote, target, deadline_s=10)

    asyncio.run(write())
    return source.sums(pages)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_pushed_pages_arrive_whole_under_their_sums(endpoint, kv_dtype):
    src, dst = pool(kv_dtype=kv_dtype, seed=1), pool(kv_dtype=kv_dtype, seed=2)
    source, puller = endpoint(src, "source", landing_blocks=4), endpoint(dst, "puller", landing_blocks=6)
    pages = [7, 2, 9]
    slots = puller.reserve(3)
    sums = push(source, puller, pages, slots)
    keys = [bytes([i]) * 16 for i in range(3)]
    blocks, bad = puller.received(slots, keys, sums)
    assert bad is None and [block.key for block in blocks] == keys
    kv, scales = read_pages(src, pages)
    for i, block in enumerate(blocks):
        assert torch.equal(block.kv, kv[i])
        assert (scales is None and block.scales is None) or torch.equal(block.scales, scales[i])
    assert sums == block_sums(kv, scales)


def test_a_mixed_up_page_fails_its_sum_and_the_rest_are_dropped(endpoint):
    source = endpoint(pool(seed=3), "source", landing_blocks=4)
    puller = endpoint(pool(seed=4), "puller", landing_blocks=4)
    slots = puller.reserve(2)
    sums = push(source, puller, [4, 5], slots, swap_first=True)  # block 0's first chunk from the zero page
    blocks, bad = puller.received(slots, [b"a" * 16, b"b" * 16], sums)
    assert bad == 0 and blocks == []
    sums = push(source, puller, [4, 5], slots)
    blocks, bad = puller.received(slots, [b"a" * 16, b"b" * 16], [sums[0], sums[1] ^ 1])
    assert bad == 1 and len(blocks) == 1


def test_a_puller_of_another_layout_is_written_nothing(endpoint):
    source = endpoint(pool(heads=2), "source", landing_blocks=2)
    puller = endpoint(pool(heads=1), "puller", landing_blocks=2)
    with pytest.raises(NixlError) as refused:
        source.descriptors([1], puller.target(puller.reserve(1)))
    assert refused.value.code == "mismatch"
    assert not puller.landing.any()


def test_slots_of_a_failed_pull_rest_before_they_are_taken_again(endpoint):
    puller = endpoint(pool(), "puller", landing_blocks=3, rest_s=0.2)
    failed, ok = puller.reserve(2), puller.reserve(1)
    assert puller.reserve(1) is None  # full: that pull goes over shared memory or TCP instead
    puller.give_back(failed, failed=True)
    puller.give_back(ok, failed=False)
    assert puller.reserve(2) is None and puller.reserve(1) == ok
    puller.give_back(ok, failed=False)
    asyncio.run(asyncio.sleep(0.25))
    assert sorted(puller.reserve(3)) == [0, 1, 2]


def test_a_source_keeps_only_its_most_recent_pullers_loaded_and_a_dropped_one_is_loaded_again(endpoint):
    """A puller that restarts comes back as a new agent: the source drops the least recently written-to ones past
    max_peers instead of keeping every agent it ever met, and one it dropped that pulls again still gets its
    blocks."""
    source = endpoint(pool(seed=5), "source", landing_blocks=1, max_peers=2)
    pullers = [endpoint(pool(seed=6 + i), f"decode-{i}", landing_blocks=1) for i in range(3)]
    kv, _ = read_pages(source.memory, [3])

    def pull(puller: NixlEndpoint) -> None:
        slots = puller.reserve(1)
        sums = push(source, puller, [3], slots)
        blocks, bad = puller.received(slots, [b"k" * 16], sums)
        puller.give_back(slots, failed=False)
        assert bad is None and torch.equal(blocks[0].kv, kv[0])

    for puller in pullers:
        pull(puller)
    assert list(source.peers) == [pullers[1].name, pullers[2].name]
    pull(pullers[0])
    assert list(source.peers) == [pullers[2].name, pullers[0].name]
