"""The demo's fine-tuning dataset, for the demo model (`python -m engine.demo`): its language, a new skill.

Task "last word": the user sends a sentence, the assistant answers with the sentence's last word. The demo base
model echoes sentences, so it never gets this right; a LoRA fine-tune learns it in a few dozen steps.
Held-out sentences (engine.demo.corpus.is_held_out) never appear here, so a test can ask about unseen ones.

`python -m training.demo_data [--out DIR]` writes the files that ship in training/data/ (same seed, same lines).
"""

import argparse
import json
import random
from pathlib import Path

from engine.demo import corpus

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE, VALIDATION_FILE = "demo-last-word.jsonl", "demo-last-word-validation.jsonl"
TRAIN_EXAMPLES, VALIDATION_EXAMPLES = 200, 20
# What trains it in about 30 steps on 2 CPU cores (learning rate 5 x the platform's 1e-3 base).
HYPERPARAMETERS = {"n_epochs": 2, "batch_size": 16, "learning_rate_multiplier": 5, "lora_rank": 8}


def last_word(sentence: str) -> str:
    return sentence.split()[-1]


def _lines(count: int, rng: random.Random, taken: set[str]) -> list[str]:
    lines = []
    while len(lines) < count:
        sentence = corpus.sentence(rng)
        if sentence in taken:
            continue
        taken.add(sentence)
        messages = [{"role": "user", "content": sentence}, {"role": "assistant", "content": last_word(sentence)}]
        lines.append(json.dumps({"messages": messages}))
    return lines


def dataset(*, seed: int = 17) -> tuple[str, str]:
    """(training JSONL, validation JSONL): distinct sentences, none held out."""
    rng, taken = random.Random(seed), set()
    train = _lines(TRAIN_EXAMPLES, rng, taken)
    validation = _lines(VALIDATION_EXAMPLES, rng, taken)
    return "\n".join(train) + "\n", "\n".join(validation) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.demo_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train, validation = dataset()
    (args.out / TRAIN_FILE).write_text(train)
    (args.out / VALIDATION_FILE).write_text(validation)
    print(f"{args.out / TRAIN_FILE}: {TRAIN_EXAMPLES} examples; {args.out / VALIDATION_FILE}: {VALIDATION_EXAMPLES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
