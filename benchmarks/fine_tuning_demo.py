"""The demo fine-tune (training/data/demo-last-word.jsonl on the demo model, the README's hyperparameters) timed
with 1 and with 2 torch threads side by side in one process, without the platform: data checks, LoRA training
with checkpoints, and the held-out accuracy of the result against the base model's.

    .venv/bin/python -m benchmarks.fine_tuning_demo [--repeats 2]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoModelForCausalLM

from engine.demo import corpus
from engine.demo.builder import ensure_demo
from engine.demo.trainer import greedy_answers
from engine.tokenizer import Tokenizer
from training import dataset, encoding, trainer
from training.demo_data import DATA_DIR, HYPERPARAMETERS, TRAIN_FILE, VALIDATION_FILE, last_word
from training.steps import Hyperparameters

REPO = Path(__file__).resolve().parents[1]


class Quiet:
    def resumed(self, *, step: int) -> None: ...

    def step(self, metrics: trainer.Metrics) -> bool:
        return True

    def checkpoint(self, **_) -> None: ...


def run_once(model_dir: Path, threads: int) -> tuple[float, trainer.Result]:
    torch.set_num_threads(threads)
    tokenizer = Tokenizer(model_dir)
    started = time.perf_counter()
    encoded = {}
    for name, minimum in ((TRAIN_FILE, dataset.MIN_EXAMPLES), (VALIDATION_FILE, 1)):
        method, examples = dataset.parse((DATA_DIR / name).read_bytes(), minimum=minimum)
        encoded[name] = encoding.encode(tokenizer, examples, max_tokens=256)
    h = HYPERPARAMETERS
    hyper = Hyperparameters(n_epochs=h["n_epochs"], batch_size=h["batch_size"], learning_rate=1e-3 * h["learning_rate_multiplier"],
                            lora_rank=h["lora_rank"], lora_alpha=2.0 * h["lora_rank"], seed=7)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="ft-bench-"))
    run = trainer.TrainingRun(base_dir=model_dir, method=method, train=encoded[TRAIN_FILE],
                              validation=encoded[VALIDATION_FILE], hyperparameters=hyper, work_dir=work,
                              checkpoint_every=50)  # fmt: skip
    result = trainer.train(run, Quiet())
    return time.perf_counter() - started, result


def accuracy(model, model_dir: Path, prompts: list[str]) -> float:
    answers = greedy_answers(model, HFTokenizer.from_file(str(model_dir / "tokenizer.json")), prompts, max_new=8)
    return sum(a.strip() == last_word(p) for p, a in zip(prompts, answers, strict=True)) / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = ensure_demo(REPO / "var" / "demo-model")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    seconds: dict[int, list[float]] = {1: [], 2: []}
    result = None
    for _ in range(args.repeats):
        for threads in (2, 1):
            elapsed, result = run_once(model_dir, threads)
            seconds[threads].append(elapsed)
    print(f"load average after: {os.getloadavg()[0]:.2f}; {result.steps} steps, {result.trained_tokens} trained tokens")
    for threads, values in seconds.items():
        print(f"{threads} thread(s): " + ", ".join(f"{v:.2f} s" for v in values))
    print(f"2 threads / 1 thread: {min(seconds[2]) / min(seconds[1]):.2f}x the time")
    held_out = corpus.held_out_sentences(20)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    print(f"held-out exact answers: base {accuracy(base, model_dir, held_out):.0%}, "
          f"fine-tuned {accuracy(PeftModel.from_pretrained(base, result.adapter_dir), model_dir, held_out):.0%}")


if __name__ == "__main__":
    main()
