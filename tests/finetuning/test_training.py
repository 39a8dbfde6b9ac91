"""The torch-side training package on the demo model, without the platform: what is learned, resuming, DPO."""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.demo import corpus
from engine.demo.builder import ensure_demo
from engine.tokenizer import Tokenizer
from tests.conftest import REPO
from training import dataset, encoding, trainer
from training.demo_data import dataset as demo_dataset
from training.steps import Hyperparameters


@pytest.fixture(scope="module")
def demo() -> Path:
    return ensure_demo(REPO / "var" / "demo-model")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on two busy cores, torch's two threads are many times slower than one
    yield
    torch.set_num_threads(threads)


class Recorder:
    def __init__(self, stop_after: int | None = None):
        self.stop_after, self.steps, self.resumed_at, self.checkpoints = stop_after, [], None, []

    def resumed(self, *, step: int) -> None:
        self.resumed_at = step

    def step(self, metrics: trainer.Metrics) -> bool:
        self.steps.append(metrics)
        return self.stop_after is None or metrics.step < self.stop_after

    def checkpoint(self, *, step: int, path: Path, metrics: trainer.Metrics) -> None:
        self.checkpoints.append(step)


def test_training_never_imports_django():
    """Its own imports name no Django and no platform app; the engine modules it uses are checked by test_layout.
    (Read from the source: importing every module would load torch, transformers and PEFT, 20-30 s in CI.)"""
    platform_apps = {path.name for path in (REPO / "platform").iterdir() if (path / "apps.py").exists()}
    for source in sorted((REPO / "training").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            roots = {name.split(".")[0] for name in names}
            assert not roots & ({"django", "quilt"} | platform_apps), (source.name, names)


def test_only_the_assistant_answer_and_its_end_of_turn_are_learned(demo):
    tokenizer = Tokenizer(demo)
    _, examples = dataset.parse(json.dumps({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sees the moon"},
        {"role": "assistant", "content": "moon"},
    ]}).encode())  # fmt: skip
    [tokens] = encoding.encode(tokenizer, examples, max_tokens=256)
    learned = [t for t in tokens.labels if t != encoding.IGNORE]
    assert tokenizer.decode(learned, skip_special_tokens=False) == "moon</s>"
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "the cat sees the moon"}])  # fmt: skip
    context = tokens.input_ids[: len(tokens.input_ids) - len(learned)]
    assert context == tokenizer.encode(prompt, add_special_tokens=False)  # exactly what the engine will see


def _run_of(demo: Path, work: Path, *, method: str = dataset.SUPERVISED, lines: bytes | None = None,
            epochs: int = 1, lr: float = 5e-3) -> trainer.TrainingRun:  # fmt: skip
    lines = lines if lines is not None else demo_dataset()[0].encode()
    _, examples = dataset.parse(lines, method=method)
    encoded = encoding.encode(Tokenizer(demo), examples[:48], max_tokens=256)
    hyper = Hyperparameters(n_epochs=epochs, batch_size=8, learning_rate=lr, lora_rank=4, lora_alpha=8, seed=5)
    return trainer.TrainingRun(base_dir=demo, method=method, train=encoded, validation=encoded[:8],
                               hyperparameters=hyper, work_dir=work, checkpoint_every=2)  # fmt: skip


def test_a_run_stopped_and_resumed_ends_where_an_uninterrupted_one_does(demo, tmp_path, one_thread):
    straight = trainer.train(_run_of(demo, tmp_path / "straight"), Recorder())
    assert straight.steps == 6 and straight.adapter_dir is not None

    interrupted = _run_of(demo, tmp_path / "interrupted")
    stopped = trainer.train(interrupted, Recorder(stop_after=3))
    assert stopped.adapter_dir is None and stopped.steps == 3
    again = Recorder()
    resumed = trainer.train(interrupted, again)
    assert again.resumed_at == 2  # the checkpoint before the stop
    assert [m.step for m in again.steps] == [3, 4, 5, 6]
    assert resumed.trained_tokens == straight.trained_tokens
    expected = load_file(str(straight.adapter_dir / "adapter_model.safetensors"))
    actual = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_dpo_moves_the_model_towards_the_preferred_answers(demo, tmp_path, one_thread):
    rows = []
    for line in demo_dataset()[0].splitlines()[:48]:
        messages = json.loads(line)["messages"]
        sentence = messages[0]["content"]
        rows.append(json.dumps({
            "input": {"messages": [messages[0]]}, "preferred_output": [messages[1]],
            "non_preferred_output": [{"role": "assistant", "content": sentence}],  # the base model's echo
        }))  # fmt: skip
    recorder = Recorder()
    result = trainer.train(_run_of(demo, tmp_path, method=dataset.DPO, lines="\n".join(rows).encode(), epochs=2),
                           recorder)  # fmt: skip
    assert result.adapter_dir is not None
    first, last = recorder.steps[0], recorder.steps[-1]
    assert first.train_loss == pytest.approx(0.6931, abs=0.01)  # log 2: the policy starts as the reference
    assert last.train_loss < first.train_loss - 0.1
    assert last.train_mean_token_accuracy == 1.0  # every pair now prefers the preferred answer


def test_the_shipped_demo_dataset_is_what_its_generator_writes():
    from training.demo_data import DATA_DIR, TRAIN_FILE, VALIDATION_FILE

    train, validation = demo_dataset()
    assert (DATA_DIR / TRAIN_FILE).read_text() == train
    assert (DATA_DIR / VALIDATION_FILE).read_text() == validation
    held_out = set(corpus.held_out_sentences(200))
    users = {json.loads(line)["messages"][0]["content"] for line in (train + validation).splitlines()}
    assert len(users) == 220 and not users & held_out


def test_auto_hyperparameters_learn_the_demo_task(demo, tmp_path, one_thread, settings):
    """A job created with no hyperparameters must learn the demo's task; with too few optimizer steps at the base
    learning rate (2 epochs of 20 steps) the adapter got 6 of 20 held-out sentences right."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from finetuning.hyperparameters import hyperparameters_resolve, learning_rate

    settings.QUILT_FINE_TUNING_BASE_LEARNING_RATE = 1e-3
    _, examples = dataset.parse(demo_dataset()[0].encode())
    h = hyperparameters_resolve(given=None, method=dataset.SUPERVISED, examples=len(examples), param="hyperparameters")
    hyper = Hyperparameters(n_epochs=h["n_epochs"], batch_size=h["batch_size"], learning_rate=learning_rate(h),
                            lora_rank=h["lora_rank"], lora_alpha=h["lora_alpha"])  # fmt: skip
    run = trainer.TrainingRun(base_dir=demo, method=dataset.SUPERVISED, validation=[], hyperparameters=hyper,
                              train=encoding.encode(Tokenizer(demo), examples, max_tokens=256), work_dir=tmp_path,
                              checkpoint_every=1000)  # fmt: skip
    result = trainer.train(run, Recorder())
    llm = LLM(demo, max_num_seqs=20)
    llm.add_adapter("last-word", result.adapter_dir)
    held_out = corpus.held_out_sentences(20)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": s}]) for s in held_out]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), adapters=["last-word"] * 20)
    right = sum(out.text.strip() == sentence.split()[-1] for out, sentence in zip(outputs, held_out, strict=True))
    assert right >= 16, (h, [out.text for out in outputs])
