"""Build (or reuse) the demo checkpoint: a tiny Llama plus PEFT adapters with visible skills."""

import fcntl
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from engine.demo import corpus
from engine.demo.tokenizer import save_tokenizer, train_tokenizer
from engine.demo.trainer import greedy_answers, llama_config, new_base_model, train

DEMO_VERSION = 3  # 2: the extract adapter (JSON), a chat template with tools; 3: one torch thread, JSON in the
# tokenizer's corpus, extract trained 400 steps
STAMP = "quilt-demo.json"
DEFAULT_OUT = Path("var/demo-model")


@dataclass(frozen=True)
class AdapterRecipe:
    skill: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    steps: int
    lr: float = 5e-3


ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPES = (
    AdapterRecipe(skill="shout", rank=4, alpha=8, target_modules=ALL_MODULES, steps=60),
    AdapterRecipe(skill="reverse", rank=8, alpha=16, target_modules=ALL_MODULES, steps=120),
    AdapterRecipe(skill="count", rank=16, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), steps=80),
    # JSON. Over 4 seeds and 32 held-out prompts, 400 steps show the skill on all of them (exact on 88-100%), 200 on
    # 94-100%; before the tokenizer learnt its words as they stand in JSON (corpus.tokenizer_corpus), 400 steps
    # showed it on 88-100% and 200 on 0-75% (exact: about none)
    AdapterRecipe(skill="extract", rank=8, alpha=16, target_modules=ALL_MODULES, steps=400, lr=1e-2),
)


@dataclass(frozen=True)
class BaseRecipe:
    hidden: int = 128
    layers: int = 3
    max_positions: int = 256
    vocab_size: int = 1024
    steps: int = 600
    batch_size: int = 32
    lr: float = 5e-3
    seed: int = 0


class Progress:
    """Steps done of the whole build, and a time estimate from the pace so far, logged every few seconds."""

    EVERY_SECONDS = 5.0

    def __init__(self, total_steps: int, log: Callable[[str], None]):
        self.total, self.done, self.log = total_steps, 0, log
        self.started = self.last = time.monotonic()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last < self.EVERY_SECONDS and self.done != self.total:
            return
        self.last = now
        left = (now - self.started) / self.done * (self.total - self.done)
        self.log(f"building the demo model: {100 * self.done // self.total}% ({self.done}/{self.total} steps), "
                 f"{_duration(now - self.started)} so far, about {_duration(left)} left")  # fmt: skip


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def adapter_dir(out: Path, skill: str) -> Path:
    return out / "adapters" / skill


def recipe_stamp(recipe: BaseRecipe) -> dict:
    return {
        "version": DEMO_VERSION,
        "base": asdict(recipe),
        "adapters": {a.skill: {**asdict(a), "path": f"adapters/{a.skill}"} for a in RECIPES},
    }


def stamp_matches(out: Path, recipe: BaseRecipe = BaseRecipe()) -> bool:
    """Whether `out` holds a finished build of this version and these recipes."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    expected = json.loads(json.dumps(recipe_stamp(recipe)))  # tuples as lists, as read back
    return all(stamp.get(key) == value for key, value in expected.items())


def ensure_demo(out: Path = DEFAULT_OUT, *, log: Callable[[str], None] = print) -> Path:
    """Return the demo directory, building it first unless a build of this version is there."""
    out = Path(out)
    if stamp_matches(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp_matches(out):
            return out
        staging = out.parent / f".{out.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        build(staging, log=log)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def build(out: Path, *, recipe: BaseRecipe = BaseRecipe(), log: Callable[[str], None] = print) -> None:
    """Train and save everything into `out`, on one torch thread: the thread count changes how float sums are
    split, so a build that switched to a second thread with the machine's load wrote other weights each time (and
    once an extract adapter that had not learnt its skill); and a second OpenMP thread sharing its core with another
    process stalls every step at its barriers (over ten times slower). One thread costs about 1.4x the wall time of
    two on an idle machine. The caller's torch RNG and thread count are left as they were."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.random.fork_rng():
            _build(out, recipe=recipe, log=log)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, *, recipe: BaseRecipe, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    tokenizer = train_tokenizer(corpus.tokenizer_corpus(random.Random(recipe.seed), lines=3000),
                                vocab_size=recipe.vocab_size)
    save_tokenizer(tokenizer, out, max_length=recipe.max_positions)
    config = llama_config(tokenizer, hidden=recipe.hidden, layers=recipe.layers,
                          max_positions=recipe.max_positions)
    model = new_base_model(config, seed=recipe.seed)
    log(f"base model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    progress = Progress(recipe.steps + sum(adapter.steps for adapter in RECIPES), log)
    train(model, tokenizer, corpus.base_example, steps=recipe.steps, batch_size=recipe.batch_size,
          lr=recipe.lr, seed=recipe.seed, log=log, on_step=progress.step)
    model.save_pretrained(out)
    held_out = corpus.held_out_sentences(8)
    checks = {"base": score(model, tokenizer, held_out, None)}
    log(f"base model on held-out prompts: {checks['base']}")

    for number, adapter in enumerate(RECIPES):
        log(f"adapter {adapter.skill}: rank {adapter.rank}, {len(adapter.target_modules)} modules")
        lora = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=0.0,
                          target_modules=list(adapter.target_modules), task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, lora)
        train(peft_model, tokenizer, lambda rng, skill=adapter.skill: corpus.adapter_example(skill, rng),
              steps=adapter.steps, batch_size=recipe.batch_size, lr=adapter.lr, seed=recipe.seed + 1 + number,
              log=log, on_step=progress.step)
        peft_model.save_pretrained(adapter_dir(out, adapter.skill))
        checks[adapter.skill] = score(peft_model, tokenizer, held_out, adapter.skill)
        log(f"adapter {adapter.skill} on held-out prompts: {checks[adapter.skill]}")
        model = peft_model.unload()

    stamp = {
        **recipe_stamp(recipe),
        "held_out_accuracy": checks,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    log(f"demo model built in {stamp['build_seconds']} s")


def score(model: torch.nn.Module, tokenizer, prompts: list[str], skill: str | None) -> dict[str, float]:
    """Fractions of prompts answered exactly right, and showing the skill's behaviour."""
    answers = [a.strip() for a in greedy_answers(model, tokenizer, prompts)]
    expected = corpus.ADAPTER_SKILLS[skill] if skill else (lambda text: text)
    pairs = list(zip(prompts, answers, strict=True))
    return {"exact": sum(a == expected(p) for p, a in pairs) / len(pairs),
            "behaviour": sum(corpus.behaves(skill, p, a) for p, a in pairs) / len(pairs)}
