"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers + PEFT: fused q/k/v and gate/up in the checkpoint,
LongRoPE (prompts shorter than the original context, longer, and crossing it while generating), a partial
rotary (0.75), tied embeddings and a sliding window; adapters in both naming styles mixed with base requests in
one batch. Greedy tokens equal and the top-1 log-probability of every generated token within 1e-4, on the
reference ops, on the Triton launchers (interpreted), and over two ranks.

Adapters on Phi-3 come with the fused names PEFT writes on the real checkpoint (qkv_proj, gate_up_proj: one A
[r, hidden] and one B [q + 2 kv, r] for all slices) or with split names (q_proj, ..., up_proj), from training
on a "llamafied" copy. PEFT cannot put a split-name adapter on the fused checkpoint, so its outside oracle is
the fused adapter that computes the same function, run by PEFT on the fused checkpoint: for qkv_proj, A is the
split A's stacked ([r_q + r_k + r_v, hidden]) and B block-diagonal (B_q in q's rows and A_q's columns, ...),
each block multiplied by its module's scaling and the fused module's scaling set to 1 (alpha = rank). Then
B @ A x = [s_q B_q A_q x; s_k B_k A_k x; s_v B_v A_v x], exactly the split adapter's deltas on the split
projections (`fused_equivalent`)."""

import json

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import adapters
import kernels
from engine import LLM, SamplingParams
from tests.engine.conftest import VOCAB, Oracle, build_adapter, random_prompts

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
CONFIG = {"block_size": 4, "num_kv_blocks": 192, "max_num_batched_tokens": 16, "max_adapter_rank": 16}
ORIGINAL = 32  # the checkpoint's original_max_position_embeddings (tests/engine/conftest.py)


def split_adapter(base_dir, directory, *, seed: int, r: int, targets: list[str], alpha: float = 16.0, **lora):
    """What PEFT writes for a Phi-3 whose q/k/v and gate/up were split into Llama's modules: PEFT on a Llama of
    the checkpoint's widths, random A and B."""
    config = json.loads((base_dir / "config.json").read_text())
    llamafied = LlamaConfig(**{k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads")}, vocab_size=VOCAB)
    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM(llamafied), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                   **lora))  # fmt: skip
    for name, param in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3 / param.shape[-1] ** 0.5 if "lora_A" in name else 0.2)
    model.save_pretrained(directory)
    return directory


def fused_equivalent(split_dir, directory, base_config: dict):
    """The fused-name PEFT adapter computing what a split-name one does (see the module's docstring): every
    module's B scaled by its own scaling and alpha = rank, q/k/v and gate/up stacked into qkv_proj and
    gate_up_proj (a slice the split adapter leaves out keeps zero rows)."""
    loaded = adapters.load_adapter(split_dir, base_config)
    shapes = adapters.BaseShapes.from_config(base_config)
    tensors, ranks = {}, {}
    for layer in range(shapes.num_layers):
        for fused, slices in {**FUSED, "o_proj": ("o_proj",), "down_proj": ("down_proj",)}.items():
            present = [s for s in slices if f"layers.{layer}.{s}" in loaded.ranks]
            if not present:
                continue
            a = torch.cat([loaded.tensors[f"layers.{layer}.{s}.lora_A"] for s in present])  # [sum r, in]
            b = torch.zeros(shapes.in_out(fused)[1], a.shape[0])  # [out, sum r]
            row = column = 0
            for split in slices:
                width = shapes.in_out(split)[1]
                key = f"layers.{layer}.{split}"
                if key in loaded.ranks:
                    rank = loaded.ranks[key]
                    b[row:row + width, column:column + rank] = loaded.tensors[f"{key}.lora_B"] * loaded.scaling[key]
                    column += rank
                row += width
            peft_key = adapters.base_shapes.peft_module_key(layer, fused)
            tensors[f"base_model.model.{peft_key}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{peft_key}.lora_B.weight"] = b
            ranks[peft_key] = a.shape[0]
    directory.mkdir(parents=True)
    safetensors.torch.save_file(tensors, directory / "adapter_model.safetensors")
    patterns = {key.replace(".", r"\."): rank for key, rank in ranks.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "target_modules": list(ranks),
              "rank_pattern": patterns, "alpha_pattern": patterns, "bias": "none"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints["phi3"]


@pytest.fixture(scope="module")
def phi3_adapters(base, tmp_path_factory):
    """name -> (what the engine loads, what PEFT runs on the fused checkpoint)."""
    root = tmp_path_factory.mktemp("phi3-adapters")
    config = json.loads((base / "config.json").read_text())
    fused4 = build_adapter(base, root / "fused4", seed=40, r=4, targets=["qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj"])  # fmt: skip
    fused8 = build_adapter(base, root / "fused8", seed=41, r=8, targets=["qkv_proj", "gate_up_proj"], use_rslora=True)
    split = split_adapter(base, root / "split", seed=42, r=4, targets=SPLIT, rank_pattern={"k_proj": 2},
                          alpha_pattern={"up_proj": 4.0})  # fmt: skip
    split_qv = split_adapter(base, root / "split-qv", seed=43, r=2, targets=["q_proj", "v_proj"], alpha=8.0)
    return {
        "fused4": (fused4, fused4),
        "fused8": (fused8, fused8),
        "split": (split, fused_equivalent(split, root / "split-as-fused", config)),
        "split-qv": (split_qv, fused_equivalent(split_qv, root / "split-qv-as-fused", config)),
    }


@pytest.fixture(scope="module")
def oracle(base, phi3_adapters):
    return Oracle(base, {name: oracle_dir for name, (_, oracle_dir) in phi3_adapters.items()})


def make_llm(base, phi3_adapters, **config) -> LLM:
    llm = LLM(base, device="cpu", **{**CONFIG, **config})
    for name, (engine_dir, _) in phi3_adapters.items():
        llm.add_adapter(name, engine_dir)
    return llm


def assert_matches_peft(oracle, prompts, names, outputs, max_tokens=MAX_TOKENS) -> None:
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        tokens, logprobs = oracle.greedy_cached(prompt, name, max_tokens)
        assert out.token_ids == tokens, f"adapter {name}, prompt of {len(prompt)}"
        got = [entry.logprob for entry in out.logprobs]
        assert got == pytest.approx(logprobs, abs=1e-4), f"adapter {name}, prompt of {len(prompt)}"


SHARED = random_prompts(90, [40])[0]  # longer than the original context and the window; asked of each


def mixed_batch(seed: int):
    """Base and adapter requests of both naming styles; prompts short (< 32 even after 8 tokens), crossing 32
    while generating, and longer than 32 (long factors throughout) and than the window (20)."""
    names = [None, "fused4", "split", "fused8", "split-qv", None, "split", "fused4"]
    prompts = random_prompts(seed, [3, 17, 28, 30, 45, 36, 9, 33])
    return prompts + [SHARED] * 5, names + [None, "fused4", "fused8", "split", "split-qv"]


def test_fused_and_split_adapters_mixed_with_base_requests_match_peft(base, phi3_adapters, oracle):
    llm = make_llm(base, phi3_adapters)
    prompts, names = mixed_batch(91)
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    # every adapter changes the output: one that loads but adds nothing would match the base here
    shared = [tuple(round(entry.logprob, 3) for entry in out.logprobs) for out in outputs[-5:]]
    assert len(set(shared)) == 5, "an adapter's output equals another's or the base's"


def test_long_prompts_use_the_long_factors_whatever_the_chunks_and_the_prefix_cache(base, phi3_adapters, oracle):
    """A 40-token prompt is prefilled in chunks of 8, none past 32 tokens on its own: every token still reads
    the long factors, as the one call transformers makes does. A short prompt's cached blocks (short factors)
    are not reused by a long one over the same tokens, and long prompts share theirs."""
    llm = make_llm(base, phi3_adapters, max_num_batched_tokens=8)
    short = SHARED[:24]
    first = llm.generate([short], SAMPLING, adapters=["split"], tenants=["t"])
    assert_matches_peft(oracle, [short], ["split"], first)
    prompts, names = [SHARED, SHARED[:37]], ["split", "split"]
    second = llm.generate(prompts[:1], SAMPLING, adapters=names[:1], tenants=["t"])
    assert second[0].usage.cached_tokens == 0  # the short prompt's blocks hold short-factor keys
    third = llm.generate(prompts[1:], SAMPLING, adapters=names[1:], tenants=["t"])
    assert third[0].usage.cached_tokens == 36  # nine blocks of the long prompt, long-factor keys alike
    assert_matches_peft(oracle, prompts, names, second + third)


def test_a_fused_name_adapter_keeps_one_copy_of_its_a_in_the_pages(base, phi3_adapters):
    """Its slices share one A (per_slice), and the plan packs those rows once: fewer bytes than the same adapter
    with a copy of A per slice, which computes the same."""
    import dataclasses

    from engine.adapter_plan import AdapterPlan
    from engine.lora_modules import per_slice, row_widths

    config = json.loads((base / "config.json").read_text())
    shapes = adapters.BaseShapes.from_config(config)
    adapter = per_slice(adapters.load_adapter(phi3_adapters["fused4"][0], config), shapes)
    copied = dataclasses.replace(adapter, tensors={name: t.clone() for name, t in adapter.tensors.items()})
    plan = {name: AdapterPlan.build(a, num_layers=shapes.num_layers, widths=row_widths(shapes), chunk=256)
            for name, a in (("shared", adapter), ("copied", copied))}
    qkv_a = 2 * 4 * shapes.hidden_size  # k's and v's rows of A, per layer
    mlp_a = 1 * 4 * shapes.hidden_size  # up's
    assert plan["shared"].local[:, 1, 0].equal(plan["shared"].local[:, 0, 0])  # k reads q's rows
    assert plan["shared"].local[:, 2, 0].equal(plan["shared"].local[:, 0, 0])
    assert plan["shared"].local[:, 5, 0].equal(plan["shared"].local[:, 4, 0])  # up reads gate's
    used = {name: int((p.local >= 0).sum()) for name, p in plan.items()}
    assert used["shared"] == used["copied"]  # every slice still has all its rows
    assert plan["shared"].num_bytes < plan["copied"].num_bytes
    assert (plan["copied"].chunks != 0).sum() - (plan["shared"].chunks != 0).sum() == shapes.num_layers * (qkv_a + mlp_a)


def test_a_step_of_fused_name_adapters_shrinks_once_per_fused_projection(base, phi3_adapters):
    """x·A once for all the slices of qkv_proj and gate_up_proj when every adapter of the step reads one A there
    (PEFT's cost); a step that also holds an adapter with an A per slice shrinks per slice."""
    import dataclasses

    from engine.adapter_plan import AdapterPlan
    from engine.lora_batch import AdapterTables, LoRABatch
    from engine.lora_modules import per_slice, row_widths

    config = json.loads((base / "config.json").read_text())
    shapes = adapters.BaseShapes.from_config(config)
    adapter = per_slice(adapters.load_adapter(phi3_adapters["fused4"][0], config), shapes)
    copied = dataclasses.replace(adapter, tensors={name: t.clone() for name, t in adapter.tensors.items()})
    shared, separate = (AdapterPlan.build(a, num_layers=shapes.num_layers, widths=row_widths(shapes), chunk=256)
                        for a in (adapter, copied))

    def step(*plans):  # on the reference path (CPU): the tables are cut for the step
        tables = [AdapterTables(key=key, offsets=p.local, expert_offsets=p.expert_local, ranks=p.ranks,
                                scaling=p.scaling, host_ranks=p.ranks, a_source=p.a_source)
                  for key, p in enumerate(plans)]
        return LoRABatch(num_layers=shapes.num_layers, device=torch.device("cpu"), zero_row=0).fill([0, -1, 1], tables)

    fused, mixed = step(shared, shared), step(shared, separate)
    for layer in range(shapes.num_layers):
        qkv, gate_up = fused.module(layer, 0, 3), fused.module(layer, 4, 2)
        assert qkv.a_rows.shape[0] == 1 and qkv.b_rows.shape[0] == 3 and qkv.a_ranks.shape == (1, 2)
        assert gate_up.a_rows.shape[0] == 1 and gate_up.b_rows.shape[0] == 2
        assert mixed.module(layer, 0, 3).a_rows.shape[0] == 3 and mixed.module(layer, 4, 2).a_rows.shape[0] == 2


def test_a_module_phi3_lacks_is_refused_by_the_engine_naming_it_and_the_family(base, tmp_path):
    directory = build_adapter(base, tmp_path / "fused", seed=44, r=2, targets=["qkv_proj"])
    config = directory / "adapter_config.json"
    config.write_text(config.read_text().replace('"qkv_proj"', '"qkv_proj", "dense"'))
    llm = LLM(base, device="cpu", **CONFIG)
    with pytest.raises(adapters.AdapterError, match="dense, which a Phi-3 base \\(Phi3ForCausalLM\\) does not have"):
        llm.add_adapter("dense", directory)


def test_on_the_triton_launchers_matches_peft(base, phi3_adapters, oracle, triton_launchers):
    llm = make_llm(base, phi3_adapters, max_num_batched_tokens=12)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    names = ["fused4", None, "split"]
    prompts = random_prompts(92, [34, 4, 22])  # long (and chunked), short, and crossing 32 while generating
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    assert_matches_peft(oracle, prompts, names, llm.generate(prompts, sampling, adapters=names), max_tokens=4)


def test_two_ranks_equal_one_and_peft(base, phi3_adapters, oracle):
    """Each rank reads its rows of every slice of the fused qkv_proj and gate_up_proj; fused-name adapters are
    split per slice before sharding, so B's rows of each slice go to the rank that holds that slice."""
    one, two = make_llm(base, phi3_adapters, tensor_parallel_size=1), make_llm(base, phi3_adapters,
                                                                                 tensor_parallel_size=2)
    names = ["fused4", None, "split", "fused8"]
    prompts = random_prompts(93, [35, 20, 6, 13])
    try:
        split = two.generate(prompts, SAMPLING, adapters=names)
    finally:
        two.engine.shutdown()
    whole = one.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, whole)
    for out, ref in zip(split, whole, strict=True):
        assert out.token_ids == ref.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


def _dequantized_int8(base, directory):
    """The checkpoint with every decoder projection (Phi-3's fused ones as they are) replaced by its int8
    dequantization: per output row, which is per row of each slice too."""
    from transformers import AutoModelForCausalLM

    from engine.quantization.on_load import dequantize, quantize_int8
    from tests.engine.conftest import build_tokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            module.weight.data = dequantize(*quantize_int8(module.weight.data))
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


def test_int8_matches_peft_on_the_dequantized_base(base, phi3_adapters, tmp_path):
    """Each fused projection is quantized once its last slice is read (the loader reads them one by one)."""
    oracle = Oracle(_dequantized_int8(base, tmp_path / "int8"),
                    {name: oracle_dir for name, (_, oracle_dir) in phi3_adapters.items()})
    llm = make_llm(base, phi3_adapters, quantization="int8")
    prompts, names = mixed_batch(94)
    assert_matches_peft(oracle, prompts[:6], names[:6], llm.generate(prompts[:6], SAMPLING, adapters=names[:6]))


def test_speculation_keeps_peft_tokens(base, phi3_adapters, oracle):
    """Greedy speculation is lossless, LongRoPE's rows included: the draft (the model itself, with its own
    Context, adapters off) proposes tokens past 32 that read the long rows, and the target verifies them. Whole
    prompts in one step, so that every request reaches its decode steps together and is speculated."""
    llm = make_llm(base, phi3_adapters, speculative_method="draft", speculative_model=str(base),
                   num_speculative_tokens=3, max_num_batched_tokens=256)  # fmt: skip
    prompts, names = mixed_batch(95)
    outputs = llm.generate(prompts[:6], SAMPLING, adapters=names[:6])
    assert_matches_peft(oracle, prompts[:6], names[:6], outputs)
    assert sum(out.usage.spec_accepted_tokens for out in outputs) > 0


def _hub_config(**fields):
    """The fields of a Phi-3 family config.json on the Hub that the spec reads (sizes as published)."""
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "rope_scaling": None, "sliding_window": None, "tie_word_embeddings": False, **fields}  # fmt: skip


def _longrope(kind: str, pairs: int) -> dict:
    return {"type": kind, "short_factor": [1.0 + i / 100 for i in range(pairs)],
            "long_factor": [1.0 + i / 10 for i in range(pairs)]}  # fmt: skip


HUB_CONFIGS = {
    "phi-3-mini-4k": _hub_config(sliding_window=2047),
    "phi-3.5-mini": _hub_config(max_position_embeddings=131072, rope_scaling=_longrope("longrope", 48),
                                sliding_window=262144),
    "phi-4-mini": _hub_config(num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
                              max_position_embeddings=131072, partial_rotary_factor=0.75, tie_word_embeddings=True,
                              rope_scaling=_longrope("longrope", 48), sliding_window=262144),
    "phi-4": _hub_config(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=10, vocab_size=100352, rope_theta=250000.0, max_position_embeddings=16384,
                         original_max_position_embeddings=16384),
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_configs_read_as_transformers_reads_them(name):
    from transformers import Phi3Config

    from engine.models import read_spec

    config = HUB_CONFIGS[name]
    spec, theirs = read_spec(config), Phi3Config(**config)
    rope = theirs.rope_parameters
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert spec.rope.rotary_dim == int(head_dim * rope["partial_rotary_factor"])
    assert spec.rope.theta == rope["rope_theta"] and spec.rope.rope_type == rope["rope_type"]
    if rope["rope_type"] == "longrope":
        assert spec.rope.original_max_positions == rope["original_max_position_embeddings"]
        assert spec.rope.scaling["long_factor"] == rope["long_factor"]
        assert spec.rope.scaling["short_factor"] == rope["short_factor"]
    assert spec.layer_windows == (theirs.sliding_window,) * theirs.num_hidden_layers
    assert spec.tie_word_embeddings == theirs.tie_word_embeddings
