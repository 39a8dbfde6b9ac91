"""The per-layer wait behind engine/page_copier.py's seam. With a copier that streams layers (as the CUDA one does)
and copies slowly, a prefill that uses an adapter starts on layer 0 before the adapter's last layer is in its pages,
each layer's LoRA waits for that layer's copy, and the tokens (and those of a base-model request in the same steps)
are transformers + PEFT's. The CPU copier does not stream: its adapter's sequences wait for the whole copy, so the
per-layer events a step would wait for are already set."""

import json
import threading
import time

import pytest

import adapters
import engine.adapter_pool
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.page_copier import CpuCopier, write_layer
from tests.engine.conftest import Oracle, build_adapter, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYER_SECONDS = 0.4  # each layer's copy: far longer than a tiny model's layer
TOKENS = 4


class SlowCopy:
    """A copy whose layers land one by one, LAYER_SECONDS apart; it notes when each landed and when a step first
    waited for each."""

    def __init__(self, offsets, num_layers: int) -> None:
        self.offsets = offsets
        self.layers = [threading.Event() for _ in range(num_layers)]
        self.copied_at: list[float | None] = [None] * num_layers
        self.waited_at: dict[int, float] = {}
        self.started = time.monotonic()

    def done(self) -> bool:
        return self.layers[-1].is_set()

    def result(self):
        self.layers[-1].wait()
        return self.offsets

    def seconds(self) -> float:
        self.result()
        return self.copied_at[-1] - self.started

    def tables(self):
        return self.offsets

    def wait_layer(self, layer: int) -> None:
        self.waited_at.setdefault(layer, time.monotonic())
        self.layers[layer].wait()


class SlowCopier:
    """A copier that streams layers, each copied by engine.page_copier.write_layer on a thread of its own."""

    streams_layers = True

    def __init__(self, memory) -> None:
        self.memory = memory
        self.copies: list[SlowCopy] = []
        self.threads: list[threading.Thread] = []

    def start(self, plan, pages, offsets) -> SlowCopy:
        copy = SlowCopy(offsets, plan.chunks.shape[0])
        mem = self.memory

        def run() -> None:
            ids = plan.chunk_ids(pages, chunk=mem.chunk, chunk_start=mem.chunk_start)
            for layer, copied in enumerate(copy.layers):
                time.sleep(LAYER_SECONDS)
                write_layer(mem, plan, layer, ids)
                copy.copied_at[layer] = time.monotonic()
                copied.set()

        thread = threading.Thread(target=run, name="slow-copier", daemon=True)
        thread.start()
        self.copies.append(copy)
        self.threads.append(thread)
        return copy

    def close(self) -> None:
        for thread in self.threads:
            thread.join()


@pytest.fixture(scope="module")
def stored(checkpoints, tmp_path_factory):
    """(digest, canonical folder, PEFT folder) of a rank-8 adapter on every projection."""
    root, base = tmp_path_factory.mktemp("page-copier"), checkpoints["llama"]
    peft_dir = build_adapter(base, root / "peft", seed=71, r=8, targets=ALL)
    adapter = adapters.load_adapter(peft_dir, json.loads((base / "config.json").read_text()))
    return adapter.digest, adapter.save(root / "canonical"), peft_dir


@pytest.fixture(scope="module")
def oracle(checkpoints, stored):
    return Oracle(checkpoints["llama"], {"slow": stored[2]})


def test_a_prefill_starts_on_the_layers_already_copied_and_its_tokens_are_peft_s(checkpoints, stored, oracle,
                                                                                 monkeypatch):
    copiers: list[SlowCopier] = []
    monkeypatch.setattr(engine.adapter_pool, "page_copier", lambda memory: copiers.append(SlowCopier(memory)) or copiers[-1])
    llm = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    digest, folder, _ = stored
    assert llm.add_adapter(folder) == digest  # in host memory: its first request places it
    adapter_prompt, base_prompt = random_prompts(72, [7, 5])
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    llm.add_request("adapter", adapter_prompt, greedy, adapter=digest)
    llm.add_request("base", base_prompt, greedy)
    outputs = {}
    first = llm.step()  # places the adapter, starts its copy and runs the prefill of both, waiting layer by layer
    assert llm.num_steps == 1
    while llm.has_unfinished():
        first += llm.step()
    for out in first:
        outputs[out.request_id] = out
    (copy,) = copiers[0].copies
    num_layers = len(copy.layers)
    assert num_layers >= 2
    assert sorted(copy.waited_at) == list(range(num_layers))  # every layer's LoRA waited for its own copy
    # the prefill began on layer 0 while later layers were still on their way (a step that waited for the whole
    # copy would have asked for layer 0 after the last layer landed)
    assert copy.waited_at[0] < copy.copied_at[-1] - LAYER_SECONDS / 2, (copy.waited_at, copy.copied_at)
    assert list(outputs["adapter"].token_ids) == oracle.greedy(adapter_prompt, "slow", TOKENS)
    assert list(outputs["base"].token_ids) == oracle.greedy(base_prompt, None, TOKENS)
    assert llm.adapter_pool.copies_under_way([digest]) == []  # done: later steps wait for nothing
    assert llm.adapter_pool.take_load_times()[-1].seconds >= num_layers * LAYER_SECONDS * 0.9
    llm.shutdown()


def test_the_cpu_copier_does_not_stream_and_its_layers_are_set_once_done(checkpoints, stored):
    llm = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    digest, folder, _ = stored
    pool = llm.adapter_pool
    assert not CpuCopier.streams_layers
    llm.add_adapter(folder)
    llm.add_request("one", random_prompts(73, [5])[0], SamplingParams(max_tokens=2), adapter=digest)
    while llm.has_unfinished():
        llm.step()
        assert llm.runner.lora.copies == []  # no step ran while a copy of its adapter was under way
    assert pool.tier(digest) == "device" and pool.copies_under_way([digest]) == []
    memory = pool.memory
    plan = pool.plan(adapters.load_canonical(folder, digest=digest))
    pages = llm.block_manager.take_pages(plan.num_pages)
    copy = CpuCopier(memory).start(plan, pages, ())
    copy.result()
    assert all(layer.is_set() for layer in copy.layers)
    for layer in range(len(copy.layers)):
        copy.wait_layer(layer)  # returns at once: already copied
    llm.block_manager.give_pages(pages)
    llm.shutdown()
