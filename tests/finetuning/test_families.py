"""Fine-tuning on every family: the LoRA goes on the projections the base's checkpoint has (Phi-3's fused
qkv_proj and gate_up_proj), and the adapter a run exports is served by the engine with the tokens transformers +
PEFT give with it. Tiny random bases, a few steps: what is learned is test_training's and test_flow's concern.

The torch-level runs cover every family; a job through /v1/fine_tuning/jobs (the real training worker, the
registry's validation) on a Qwen3 and a Phi-3 base covers the platform's path."""

import json

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.conftest import Oracle, build_checkpoint
from tests.finetuning.conftest import client, wait_for
from training import dataset, encoding, trainer
from training.steps import Hyperparameters

SAMPLING = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
PROJECTIONS = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
}


def _lines(count: int = 12) -> bytes:
    """Chat examples in the tiny checkpoints' vocabulary (w6 ... w159): answer a sentence's last word."""
    rows = []
    for i in range(count):
        words = [f"w{10 + (7 * i + 3 * j) % 140}" for j in range(4)]
        rows.append({"messages": [{"role": "user", "content": " ".join(words)},
                                  {"role": "assistant", "content": words[-1]}]})  # fmt: skip
    return "\n".join(json.dumps(row) for row in rows).encode()


def _saved_modules(adapter_dir) -> set[str]:
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        return {name.split(".")[-3] for name in f.keys()}  # ...self_attn.qkv_proj.lora_A.weight


def _assert_served_as_peft(base, adapter_dir) -> None:
    llm = LLM(base, device="cpu", block_size=4, num_kv_blocks=64, max_adapter_rank=8)
    llm.add_adapter("tuned", adapter_dir)
    oracle = Oracle(base, {"tuned": adapter_dir})
    prompts = [[3, 5, 40, 41, 42, 43, 2, 4, 5], [3, 5, 90, 12, 7, 2, 4, 5]]
    outputs = llm.generate(prompts, SAMPLING, adapters=["tuned", "tuned"])
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = oracle.greedy_cached(prompt, "tuned", SAMPLING.max_tokens)
        assert out.token_ids == tokens
        assert [entry.logprob for entry in out.logprobs] == pytest.approx(logprobs, abs=1e-4)
        _, base_logprobs = oracle.greedy_cached(prompt, None, SAMPLING.max_tokens)
        assert logprobs != pytest.approx(base_logprobs, abs=1e-3), "the trained adapter changes nothing"


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3", "phi3"])
def test_a_run_targets_the_familys_projections_and_is_served_as_peft_runs_it(arch, tmp_path, one_thread):
    base = build_checkpoint(tmp_path / "base", arch, seed=20)
    _, examples = dataset.parse(_lines())
    run = trainer.TrainingRun(
        base_dir=base, method=dataset.SUPERVISED, train=encoding.encode(Tokenizer(base), examples, max_tokens=64),
        validation=[], hyperparameters=Hyperparameters(n_epochs=1, batch_size=4, learning_rate=5e-2, lora_rank=4,
                                                       lora_alpha=8, seed=3),
        work_dir=tmp_path / "work", checkpoint_every=100,
    )  # fmt: skip
    result = trainer.train(run, _Silent())
    assert result.steps == 3 and result.adapter_dir is not None
    assert _saved_modules(result.adapter_dir) == PROJECTIONS.get(arch, PROJECTIONS["llama"])
    _assert_served_as_peft(base, result.adapter_dir)


class _Silent:
    def resumed(self, *, step: int) -> None: ...

    def step(self, metrics) -> bool:
        return True

    def checkpoint(self, **_) -> None: ...


@pytest.fixture(scope="module")
def family_bases(ft_stack, django_db_blocker, tmp_path_factory):
    """Tiny Qwen3 and Phi-3 bases registered beside the stack's demo model, committed before any test's
    transaction opens (the gateway and the training worker read them); the package's flush removes them."""
    from django.core.management import call_command

    bases = {}
    for arch in ("qwen3", "phi3"):
        bases[arch] = build_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed=21)
        with django_db_blocker.unblock():
            call_command("registerbasemodel", f"tiny-{arch}", str(bases[arch]), verbosity=0)
    return bases


@pytest.mark.django_db
@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_a_job_on_the_family_completes_and_its_adapter_is_served_as_peft_runs_it(ft_stack, family_bases, arch):
    from registry.models import Adapter
    from registry.storage import canonical_local_dir

    base = family_bases[arch]
    tuner = client(ft_stack, "main")
    training = tuner.files.create(file=("train.jsonl", _lines()), purpose="fine-tune")
    created = tuner.fine_tuning.jobs.create(
        model=f"tiny-{arch}", training_file=training.id, suffix=f"{arch}-words", seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 2.0, "lora_rank": 4, "lora_alpha": 8}}},
    )  # fmt: skip
    job = wait_for(lambda: (j := tuner.fine_tuning.jobs.retrieve(created.id)).status in ("succeeded", "failed")
                   and j, timeout=120, what=f"the {arch} job finishing", interval=0.5)  # fmt: skip
    assert job.status == "succeeded", job.error
    version = Adapter.objects.get(tenant_id=ft_stack.ids["main"], name=f"{arch}-words").current_version
    canonical = canonical_local_dir(digest=version.digest)
    assert set(version.target_modules) == PROJECTIONS.get(arch, PROJECTIONS["llama"])
    _assert_served_as_peft(base, canonical)
