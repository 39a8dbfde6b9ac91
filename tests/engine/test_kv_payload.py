"""KV blocks exported from one engine's pool and imported into another's: the importer then serves the prompt
as a prefix hit, token for token as transformers + PEFT; a block under any key but the importer's own is
refused; payload bytes round-trip and a damaged payload is refused."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_keys import base_digest, chain, model_digest, namespace
from engine.kv import payload
from tests.engine.conftest import Oracle, build_adapter, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters_dirs(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("kv-adapters"), checkpoints["llama"]
    return {
        "qv": build_adapter(base, root / "qv", seed=20, r=4, targets=["q_proj", "v_proj"]),
        "kv": build_adapter(base, root / "kv", seed=21, r=2, targets=["k_proj", "v_proj", "o_proj"]),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints, adapters_dirs):
    return Oracle(checkpoints["llama"], adapters_dirs)


def make_llm(checkpoints, adapters_dirs, **config):
    config = {"device": "cpu", "block_size": 4, "num_kv_blocks": 48, **config}
    llm = LLM(checkpoints["llama"], **config)
    for name, path in adapters_dirs.items():
        llm.add_adapter(name, path)
    return llm


def keys_of(llm, prompt, name, tenant="default"):
    return llm.engine.kv_keys(prompt, adapter=llm.adapters.get(name), tenant=tenant)


def assert_no_leak(llm):
    bm = llm.engine.block_manager
    assert not bm.held and bm.num_free_blocks + len(bm.adapter_pages) == bm.num_blocks
    bm.check_invariants([])


def test_imported_blocks_serve_a_prefix_hit_matching_peft(checkpoints, adapters_dirs, oracle):
    source, target = make_llm(checkpoints, adapters_dirs), make_llm(checkpoints, adapters_dirs)
    system = random_prompts(30, [13])[0]
    prompts = [system + tail for tail in random_prompts(31, [3, 6, 2])]
    names = ["qv", None, "kv"]
    source.generate(prompts, GREEDY, adapters=names)
    for prompt, name in zip(prompts, names, strict=True):
        keys = keys_of(target, prompt, name)
        assert keys == keys_of(source, prompt, name)  # the same base, adapter content and salt: the same keys
        blocks = payload.decode(payload.encode(source.engine.export_blocks(keys)))
        assert len(blocks) == len(keys) == len(prompt) // 4
        assert target.engine.import_blocks(blocks, keys) == len(keys)
        assert target.engine.import_blocks(blocks, keys) == 0  # already there
    outputs = target.generate(prompts, GREEDY, adapters=names)
    assert [o.usage.cached_tokens for o in outputs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens)
    assert_no_leak(source)
    assert_no_leak(target)


def test_a_block_under_another_key_is_refused(checkpoints, adapters_dirs, oracle):
    source, target = make_llm(checkpoints, adapters_dirs), make_llm(checkpoints, adapters_dirs)
    prompt = random_prompts(32, [14])[0]
    source.generate([prompt], GREEDY, adapters=["qv"], tenants=["t1"])
    blocks = source.engine.export_blocks(keys_of(source, prompt, "qv", "t1"))
    assert len(blocks) == 3
    free = target.engine.block_manager.num_free_blocks
    # another adapter's content, another tenant's salt, no adapter: none of them is this block's key
    for name, tenant in [("kv", "t1"), ("qv", "t2"), (None, "t1")]:
        assert target.engine.import_blocks(blocks, keys_of(target, prompt, name, tenant)) == 0
    # blocks out of chain order: the first is not the key of the first place
    assert target.engine.import_blocks(blocks[1:], keys_of(target, prompt, "qv", "t1")) == 0
    # another prompt's keys
    other = random_prompts(33, [14])[0]
    assert target.engine.import_blocks(blocks, keys_of(target, other, "qv", "t1")) == 0
    assert target.engine.block_manager.num_free_blocks == free and not target.engine.block_manager.cached
    out = target.generate([prompt], GREEDY, adapters=["qv"], tenants=["t2"])[0]
    assert out.usage.cached_tokens == 0 and out.token_ids == oracle.greedy(prompt, "qv", GREEDY.max_tokens)
    assert_no_leak(target)


def test_fp8_pages_move_as_fp8_with_their_scales(checkpoints, adapters_dirs):
    fp8 = {"kv_cache_dtype": "fp8", "block_size": 16}  # a page must hold an adapter row
    source, target, colocated = (make_llm(checkpoints, adapters_dirs, **fp8) for _ in range(3))
    prompt = random_prompts(34, [37])[0]
    first = source.generate([prompt], GREEDY, adapters=["kv"])[0]
    keys = keys_of(target, prompt, "kv")
    blocks = payload.decode(payload.encode(source.engine.export_blocks(keys)))
    assert blocks[0].layout.kv_dtype == "float8_e4m3fn" and blocks[0].scales is not None
    assert blocks[0].k(0).dtype == torch.float8_e4m3fn and blocks[0].scales.abs().sum() > 0
    assert target.engine.import_blocks(blocks, keys) == 2
    # the pages and scales are the source's, bit for bit
    src_ids = [source.engine.block_manager.cached[k] for k in keys]
    dst_ids = [target.engine.block_manager.cached[k] for k in keys]
    for layer in range(len(source.engine.memory.layers)):
        src, dst = source.engine.memory, target.engine.memory
        assert torch.equal(src.layers[layer][:, src_ids].view(torch.uint8), dst.layers[layer][:, dst_ids].view(torch.uint8))
        assert torch.equal(src.scales[layer][:, src_ids], dst.scales[layer][:, dst_ids])
    hit = target.generate([prompt], GREEDY, adapters=["kv"])[0]
    assert hit.usage.cached_tokens == 32
    assert hit.token_ids == colocated.generate([prompt], GREEDY, adapters=["kv"])[0].token_ids == first.token_ids
    # an fp8 block is not a float32 pool's block
    plain = make_llm(checkpoints, adapters_dirs, block_size=16)
    assert plain.engine.import_blocks(blocks, keys_of(plain, prompt, "kv")) == 0
    assert keys_of(plain, prompt, "kv") != keys  # and the keys say so too: the numerics are in the base digest


def test_payload_bytes_are_checked(checkpoints, adapters_dirs):
    llm = make_llm(checkpoints, adapters_dirs)
    prompt = random_prompts(35, [9])[0]
    llm.generate([prompt], GREEDY)
    blocks = llm.engine.export_blocks(keys_of(llm, prompt, None))
    data = payload.encode(blocks)
    again = payload.decode(data)
    assert [b.key for b in again] == [b.key for b in blocks]
    assert all(torch.equal(a.kv, b.kv) for a, b in zip(again, blocks, strict=True))
    assert payload.decode(payload.encode([])) == []
    damaged = bytearray(data)
    damaged[-1] ^= 1
    for bad in (bytes(damaged), data[:-3], b"nope" + data[4:], b""):
        with pytest.raises(payload.PayloadError):
            payload.decode(bad)


def test_keys_name_base_adapter_salt_and_tokens(checkpoints, tmp_path):
    digest = model_digest(checkpoints["llama"])
    assert digest == model_digest(checkpoints["llama"]) != model_digest(checkpoints["qwen2"])
    base = base_digest(digest, dtype="float32", quantization=None, kv_cache_dtype="auto", tensor_parallel_size=1)
    assert base != base_digest(digest, dtype="bfloat16", quantization=None, kv_cache_dtype="auto",
                               tensor_parallel_size=1)
    tokens = list(range(10))
    keys = chain(namespace(base, "a" * 64, "t"), tokens, 4)
    assert len(keys) == 2 and chain(namespace(base, "a" * 64, "t"), tokens, 4, start=keys[:1]) == keys
    for other in [namespace("x", "a" * 64, "t"), namespace(base, "b" * 64, "t"), namespace(base, "a" * 64, "u"),
                  namespace(base, None, "t")]:
        assert set(chain(other, tokens, 4)).isdisjoint(keys)
    assert chain(namespace(base, "a" * 64, "t"), [9] + tokens[1:], 4)[1] != keys[1]  # the parent is in the key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_blocks_move_between_cuda_engines(checkpoints, adapters_dirs, kv_cache_dtype):
    """Exported through pinned staging, framed as bytes, imported into another CUDA engine: its prefix hit gives
    the colocated run's tokens (bfloat16, fp8 pages with their scales)."""
    cuda = {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype, "block_size": 16}
    source, target, colocated = (make_llm(checkpoints, adapters_dirs, **cuda) for _ in range(3))
    prompts, names = random_prompts(36, [40, 50]), ["qv", None]
    source.generate(prompts, GREEDY, adapters=names)
    for prompt, name in zip(prompts, names, strict=True):
        keys = keys_of(target, prompt, name)
        exported = source.engine.export_blocks(keys)
        assert exported[0].kv.is_pinned()
        assert target.engine.import_blocks(payload.decode(payload.encode(exported)), keys) == len(keys)
    hits = target.generate(prompts, GREEDY, adapters=names)
    assert [o.usage.cached_tokens for o in hits] == [32, 48]
    cold = colocated.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in hits] == [o.token_ids for o in cold]
    assert_no_leak(source)
    assert_no_leak(target)
