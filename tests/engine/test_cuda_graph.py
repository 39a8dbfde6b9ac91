"""The decode path CUDA graphs capture, checked on CPU (engine/cuda_graph.py, docs/gpu.md).

- The replay contract: decode steps run twice through the same static buffers (the same storage, checked by
  data_ptr), refilled in place with another mix of adapters, other lengths and other blocks, give the eager
  forward's hidden states each time; on the references and on the Triton launchers (interpreted). With the
  static path on, greedy tokens equal transformers + PEFT's.
- No host sync in the forward: `.item()`, `.tolist()`, `.cpu()`, `int()`, `float()` or `bool()` of a tensor
  called from engine/ or kernels/ while the decode forward runs fails the test (Triton's interpreter may read
  its own arguments back: it is the device there).
The same on a GPU, captured and replayed: tests/engine/test_cuda_graph_gpu.py."""

import inspect
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.step_inputs import StepInputs
from kernels.lora_meta import LoRAMeta
from tests.engine.conftest import Oracle, build_adapter, build_checkpoint, random_prompts
from tests.engine.test_families import ALL, assert_matches_peft

REPO = Path(__file__).resolve().parents[2]
OURS = (str(REPO / "engine"), str(REPO / "kernels"))
CONFIG = {"block_size": 4, "num_kv_blocks": 96, "max_num_batched_tokens": 16, "max_num_seqs": 8,
          "max_adapter_rank": 8}


@pytest.fixture(scope="module")
def adapter_dirs(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("graph-adapters"), checkpoints["llama"]
    return {
        "all4": build_adapter(base, root / "all4", seed=90, r=4, targets=ALL),
        "all8": build_adapter(base, root / "all8", seed=91, r=8, targets=ALL, use_rslora=True),
        "qv2": build_adapter(base, root / "qv2", seed=92, r=2, targets=["q_proj", "v_proj"], alpha=8.0),
    }


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer Llama and its adapters: the interpreter runs each kernel program as Python."""
    root = tmp_path_factory.mktemp("graph-one-layer")
    base = build_checkpoint(root / "llama", "llama", seed=12, num_layers=1)
    return {"llama": base}, {
        "all4": build_adapter(base, root / "all4", seed=93, r=4, targets=ALL),
        "all8": build_adapter(base, root / "all8", seed=94, r=8, targets=ALL, use_rslora=True),
        "qv2": build_adapter(base, root / "qv2", seed=95, r=2, targets=["q_proj", "v_proj"], alpha=8.0),
    }


def make_llm(checkpoints, adapter_dirs, *, static: bool, arch: str = "llama", **config) -> LLM:
    """static: decode through the static buffers, eagerly (on CUDA the engine captures them by default)."""
    llm = LLM(checkpoints[arch], **{"device": "cpu", **CONFIG, **config})
    for name, path in adapter_dirs.items():
        digest = llm.add_adapter(name, path)
        llm.engine.prefetch_adapter(digest, "device")
    if static:
        engine = llm.engine
        engine.runner.graphs = engine.runner.static_decode(max_batch=engine.config.max_num_seqs,
                                                           max_model_len=engine.max_model_len,
                                                           max_adapter_rank=engine.config.max_adapter_rank,
                                                           capture=False, max_tokens=engine.config.max_num_batched_tokens)
    return llm


class DecodeSteps:
    """Made-up decode steps over pages of random KV taken from the pool (as a scheduler would hand them)."""

    def __init__(self, llm: LLM, seed: int) -> None:
        self.llm, self.rng = llm, random.Random(seed)
        engine = llm.engine
        self.block = engine.config.block_size
        self.pages = engine.block_manager.take_pages(48)
        gen = torch.Generator().manual_seed(seed)
        index = torch.tensor(self.pages)
        for layer in range(len(engine.runner.model.model.layers)):
            for cache in engine.memory.kv_cache(layer):
                cache[index.to(cache.device)] = torch.randn(len(index), *cache.shape[1:], generator=gen).to(cache)

    def step(self, adapters: list[str | None], lens: list[int]) -> StepInputs:
        """One decode step: sequence i of context lens[i] (its new token last) with adapters[i], in the runner's
        order (adapter by adapter, base model last), its blocks drawn from the random pages."""
        digests = sorted({self.llm.adapters[a] for a in adapters if a is not None})
        slots = [-1 if a is None else digests.index(self.llm.adapters[a]) for a in adapters]
        order = sorted(range(len(adapters)), key=lambda i: len(digests) if slots[i] < 0 else slots[i])
        free = self.rng.sample(self.pages, len(self.pages))
        inputs = StepInputs([], [], [], [], [], [0], [], [], digests)
        for i in order:
            n = lens[i]
            used = -(-n // self.block)
            table, free = free[:used], free[used:]
            inputs.input_ids.append(self.rng.randrange(6, 160))
            inputs.positions.append(n - 1)
            inputs.slot_mapping.append(table[(n - 1) // self.block] * self.block + (n - 1) % self.block)
            inputs.block_tables.append(table)
            inputs.context_lens.append(n)
            inputs.cu_seqlens_q.append(len(inputs.input_ids))
            inputs.prompt_lens.append(max(n - 3, 1))
            inputs.token_slots.append(slots[i])
        return inputs


def static_forward(llm: LLM, inputs: StepInputs) -> torch.Tensor:
    runner = llm.engine.runner
    steps = runner.graphs.steps
    hidden = runner.forward(inputs)
    assert runner.graphs.steps == steps + 1, "the step did not go through the static buffers"
    return hidden


def eager_forward(llm: LLM, inputs: StepInputs) -> torch.Tensor:
    runner = llm.engine.runner
    return runner.model(*runner.eager_inputs(inputs))


@contextmanager
def storage_seen(model):
    """The data_ptr of what each forward reads: token ids, the Context's tensors, the LoRA tables of layer 0's
    qkv_proj."""
    seen = []

    def hook(module, args):
        input_ids, ctx = args
        ptrs = {"input_ids": input_ids.data_ptr()}
        for name in ("positions", "slot_mapping", "block_tables", "context_lens", "prompt_lens"):
            ptrs[name] = getattr(ctx, name).data_ptr()
        if ctx.lora is not None and isinstance(ctx.lora.meta, LoRAMeta):  # the launchers' (references: host-side)
            ptrs["token_slots"] = ctx.lora.token_slots.data_ptr()
            tables = ctx.lora.module(0, 0, 3)
            ptrs |= {f"lora.{f}": getattr(tables, f).data_ptr() for f in ("a_rows", "b_rows", "ranks", "scaling")}
        seen.append(ptrs)

    handle = model.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


MIXES = [(["all4", None, "all8"], [5, 11, 2]), (["qv2", "all8", None, "qv2"], [9, 1, 14, 7]),
         ([None, None], [6, 3])]  # two steps in one bucket (4): other adapters, lengths, blocks; then the base alone


def check_replay_contract(llm: LLM, mixes=MIXES) -> None:
    steps = DecodeSteps(llm, seed=7)
    model, graphs = llm.engine.runner.model, llm.engine.runner.graphs
    with storage_seen(model) as seen:
        for adapters, lens in mixes:
            inputs = steps.step(adapters, lens)
            got = static_forward(llm, inputs)  # first: both store this step's KV, the same
            want = eager_forward(llm, inputs)
            assert got.shape == want.shape == (len(lens), model.spec.hidden_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            logits_got, logits_want = model.compute_logits(got), model.compute_logits(want)
            assert logits_got.argmax(-1).tolist() == logits_want.argmax(-1).tolist()
    static_reads = seen[0::2]  # the static forward's, then the eager one's, per step
    assert static_reads[0] == static_reads[1], "the second step read other storage than the first"
    buffers = graphs.buffers
    assert static_reads[0]["block_tables"] == buffers["block_tables"].data_ptr()
    if kernels.backend_for(buffers["input_ids"]) == "triton":  # the LoRA tables a graph would hold: the same too
        assert static_reads[0]["lora.a_rows"] == llm.engine.runner.lora.offsets.data_ptr()
    for later in static_reads[2:]:  # another bucket, no adapters: still the same storage
        assert all(later[k] == v for k, v in static_reads[0].items() if k in later)
    assert seen[1]["block_tables"] != buffers["block_tables"].data_ptr()  # the eager forward reads its own
    assert graphs.steps == len(mixes)


def test_replay_contract_on_the_references(checkpoints, adapter_dirs):
    check_replay_contract(make_llm(checkpoints, adapter_dirs, static=True))


def test_replay_contract_and_no_host_sync_on_the_triton_launchers(one_layer, triton_launchers):
    """What a CUDA graph captures, every op on its launcher (interpreted), adapters included: the two steps of
    one bucket through the same buffers give the eager result, and no forward reads a tensor back."""
    llm = make_llm(*one_layer, static=True, max_num_seqs=4)  # 4 adapter slots: a faster interpreter
    with no_host_sync_in(llm.engine.runner.model):
        check_replay_contract(llm, MIXES[:2])


def test_static_decode_matches_peft(checkpoints, adapter_dirs):
    llm = make_llm(checkpoints, adapter_dirs, static=True)
    names = ["all4", None, "all8", "qv2", "all8"]
    prompts = random_prompts(93, [6, 3, 10, 2, 5])
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, sampling, adapters=names)
    assert llm.engine.runner.graphs.steps >= 4  # the decode steps went through the static buffers
    assert_matches_peft(Oracle(checkpoints["llama"], adapter_dirs), prompts, names, outputs, max_tokens=5)


class HostSync(AssertionError):
    pass


@contextmanager
def no_host_sync_in(model):
    """Make reading a tensor back to the host, from engine/ or kernels/ code, raise while model's forward runs."""
    armed = [False]
    originals = {}

    def guarded(name, original):
        def method(self, *args, **kwargs):
            caller = inspect.currentframe().f_back
            if armed[0] and caller.f_code.co_filename.startswith(OURS):
                raise HostSync(f"Tensor.{name} in the forward at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return method

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        originals[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, guarded(name, originals[name]))
    hooks = [model.register_forward_pre_hook(lambda *_: armed.__setitem__(0, True)),
             model.register_forward_hook(lambda *_: armed.__setitem__(0, False))]
    try:
        yield
    finally:
        armed[0] = False
        for hook in hooks:
            hook.remove()
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_guard_catches_a_sync(checkpoints, adapter_dirs):
    """The guard is live: a forward that reads a tensor back fails."""
    llm = make_llm(checkpoints, adapter_dirs, static=False)
    model = llm.engine.runner.model

    def reads_back(module, args) -> None:
        args[1].sum().item()  # what a data-dependent branch in a layer would do

    reads_back.__code__ = reads_back.__code__.replace(co_filename=str(REPO / "engine" / "models" / "layers.py"))
    handle = model.model.layers[0].register_forward_pre_hook(reads_back)
    inputs = DecodeSteps(llm, seed=3).step([None], [4])
    with no_host_sync_in(model), pytest.raises(HostSync, match="item"):
        eager_forward(llm, inputs)
    handle.remove()


def check_no_host_sync(llm: LLM, adapters: list[str | None]) -> None:
    steps = DecodeSteps(llm, seed=11)
    with no_host_sync_in(llm.engine.runner.model):
        for lens in ([5, 40, 3], [9, 2, 37]):  # past the windows (8) and LongRoPE's original context (32)
            inputs = steps.step(adapters, lens)
            static_forward(llm, inputs)
            eager_forward(llm, inputs)


@pytest.mark.parametrize(("arch", "config"), [
    ("llama", {}), ("gemma2", {}), ("gemma3", {}), ("phi3", {}), ("qwen3", {}), ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "fp8", "kv_cache_dtype": "fp8", "block_size": 16}),
], ids=["llama", "gemma2", "gemma3", "phi3", "qwen3", "int8", "fp8"])
def test_decode_forward_makes_no_host_sync_on_the_references(checkpoints, arch, config):
    """The CPU path, base model, families with windows, soft-caps, LongRoPE, q/k norms, quantized weights and KV:
    the decode attention's buckets are cut before the forward. (The references of the LoRA ops group tokens on the
    host by design: the path with adapters is the launchers', test_replay_contract_and_no_host_sync_on_the_triton_launchers.)"""
    check_no_host_sync(make_llm(checkpoints, {}, static=True, arch=arch, **config), [None, None, None])
