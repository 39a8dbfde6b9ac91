"""The block size: a page's chunk must hold the widest adapter row (docs/engine-memory.md). Left unset, the engine
picks the smallest power of two from 16 that does; set too small, it refuses and names one that works.

Tiny checkpoints with the ratios that bite at full size: Qwen2-7B (an intermediate row of 18944 values over 4 KV
heads of 128 per token: 37 tokens of a chunk, so block 64) and Llama-3-8B with an fp8 KV cache (14336 over
8 heads of 128 fp8 bytes, half as many bf16 values: 28 tokens, so block 32; 16 fits without fp8). Here: 2 KV
heads of 16 in float32, intermediate 1184 (37 tokens) and 224 (28 tokens with fp8, 7 without)."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.__main__ import engine_config, parse_args
from engine.__main__ import main as cli_main
from engine.config import EngineConfig
from engine.models import read_hf_config, read_spec
from engine.page_budget import count_pages, page_shape
from engine.paged_memory import PagedMemory
from tests.engine.conftest import (
    ARCHS,
    VOCAB,
    Oracle,
    build_adapter,
    build_tokenizer,
    random_prompts,
    wait_until_healthy,
)
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def shaped_checkpoint(directory: Path, arch: str, *, intermediate: int) -> Path:
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                        initializer_range=0.15, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(7)
    model_cls(config).eval().save_pretrained(directory)
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def qwen2_7b_like(tmp_path_factory):
    return shaped_checkpoint(tmp_path_factory.mktemp("qwen2-7b-like") / "base", "qwen2", intermediate=1184)


@pytest.fixture(scope="module")
def llama_3_8b_like(tmp_path_factory):
    return shaped_checkpoint(tmp_path_factory.mktemp("llama-3-8b-like") / "base", "llama", intermediate=224)


def test_unset_block_size_is_chosen_to_fit_and_matches_peft(qwen2_7b_like, tmp_path):
    adapter = build_adapter(qwen2_7b_like, tmp_path / "mlp", seed=90, r=4, targets=["gate_proj", "down_proj"])
    llm = LLM(qwen2_7b_like, num_kv_blocks=48)
    llm.add_adapter("mlp", adapter)
    assert llm.engine.config.block_size == 64 and llm.engine.state()["block_size"] == 64
    prompts = random_prompts(91, [5, 12, 3])
    names = ["mlp", None, "mlp"]
    outputs = llm.generate(prompts, GREEDY, adapters=names)
    oracle = Oracle(qwen2_7b_like, {"mlp": adapter})
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens), name


@pytest.mark.parametrize("block_size", [16, 8])
def test_a_block_size_too_small_exits_2_naming_one_that_fits(llama_3_8b_like, monkeypatch, capsys, block_size):
    monkeypatch.setenv("QUILT_ENGINE_TOKEN", "t")
    code = cli_main(["--model", str(llama_3_8b_like), "--kv-cache-dtype", "fp8", "--block-size", str(block_size)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"invalid engine configuration: block_size {block_size} is too small" in err
    assert "use block_size 32 or more (or leave block_size unset: the engine then picks it)" in err


def test_the_pool_flags_former_names_map_to_what_they_size_with_a_warning(checkpoints):
    model = str(checkpoints["llama"])
    with pytest.warns(FutureWarning, match="max_adapter_slots is deprecated: it is pool_adapters_at_max_rank"):
        config = EngineConfig(model=model, max_adapter_slots=3)
    assert config.pool_adapters_at_max_rank == 3 and config.max_adapter_slots is None
    with pytest.warns(FutureWarning, match="adapter_memory_bytes is deprecated: it is pool_adapter_bytes"):
        config = EngineConfig(model=model, num_kv_blocks=8, adapter_memory_bytes=0)
    assert config.pool_adapter_bytes == 0
    assert LLM(model, num_kv_blocks=8, pool_adapter_bytes=0).engine.block_manager.num_blocks == 8  # KV pages only
    with pytest.raises(ValueError, match="max_adapter_slots is the deprecated name of pool_adapters_at_max_rank"):
        EngineConfig(model=model, max_adapter_slots=3, pool_adapters_at_max_rank=4)


def test_a_deprecated_flag_beside_its_new_name_exits_2(checkpoints, monkeypatch, capsys):
    monkeypatch.setenv("QUILT_ENGINE_TOKEN", "t")
    code = cli_main(["--model", str(checkpoints["llama"]), "--adapter-memory-bytes", "0", "--pool-adapter-bytes", "8"])
    assert code == 2
    assert "adapter_memory_bytes is the deprecated name of pool_adapter_bytes: give pool_adapter_bytes alone" in (
        capsys.readouterr().err)


@pytest.mark.timeout(180)
def test_cli_with_fp8_kv_and_no_block_size_serves(llama_3_8b_like, tmp_path):
    """What a user runs: `python -m engine --model <llama-3-8b-shaped dir> --kv-cache-dtype fp8`."""
    port = free_port()
    command = [sys.executable, "-m", "engine", "--model", str(llama_3_8b_like), "--kv-cache-dtype", "fp8",
               "--port", str(port), "--usage-spool", str(tmp_path / "usage.jsonl"), "--broker-url", ""]
    env = {**os.environ, "QUILT_ENGINE_TOKEN": "t", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer t"}, timeout=30)
    try:
        wait_until_healthy(process, client, log_path, timeout=120)
        assert client.get("/v1/state").json()["block_size"] == 32
        body = {"prompt_token_ids": [7, 8, 9], "stream": False, "sampling": {"temperature": 0, "max_tokens": 3, "ignore_eos": True}}
        assert len(client.post("/v1/generate", json=body).json()["token_ids"]) == 3
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


def test_on_cuda_the_nixl_landing_area_is_kept_out_of_the_pools_share_of_free_memory(checkpoints, monkeypatch):
    """The pool takes kv_cache_memory_fraction of the free device memory less the landing area that NIXL
    registers after it; the CLI reserves --kv-transfer-landing-mb only where NIXL may be used."""
    model = str(checkpoints["llama"])
    hf_config = read_hf_config(model)
    spec = read_spec(hf_config)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))

    def pages(**fields) -> int:
        config = EngineConfig(model=model, block_size=16, **fields)
        shape = page_shape(config, spec, hf_config, dtype=torch.float32, kv_dtype=torch.float32)
        return count_pages(config, spec, device=torch.device("cuda"), model_dtype=torch.float32,
                           kv_dtype=torch.float32, widths=shape.widths, chunk=shape.chunk, max_model_len=256,
                           tensor_parallel_size=1, workers_free=[])

    page_bytes = PagedMemory.bytes_per_page(num_layers=spec.num_layers, block_size=16, kv_heads=spec.num_kv_heads,
                                            head_dim=spec.head_dim, itemsize=4, kv_scales=False)
    landing = 64 << 20
    assert pages() == int((1 << 30) * 0.8) // page_bytes
    assert pages(kv_landing_bytes=landing) == (int((1 << 30) * 0.8) - landing) // page_bytes

    flags = ["--model", model, "--kv-transfer-landing-mb", "64"]
    assert engine_config(parse_args(flags)).kv_landing_bytes == landing
    for backend in ("shm", "tcp"):
        assert engine_config(parse_args([*flags, "--kv-transfer-backend", backend])).kv_landing_bytes == 0
    with pytest.raises(ValueError, match="kv_landing_bytes must be >= 0"):
        EngineConfig(model=model, kv_landing_bytes=-1)
