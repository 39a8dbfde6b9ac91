"""How a run is cut into steps, without torch (the platform counts steps when it creates a job).

Batches are a pure function of (seed, step): each epoch is a seeded shuffle of the examples, so a run resumed
from a checkpoint at step s trains on exactly the batches the killed run would have.
"""

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Hyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate: float
    lora_rank: int
    lora_alpha: float
    beta: float = 0.1  # DPO: how far from the base model the preferences may pull
    seed: int = 0


def steps_per_epoch(examples: int, batch_size: int) -> int:
    return math.ceil(examples / batch_size)


def total_steps(examples: int, hyperparameters: Hyperparameters) -> int:
    return hyperparameters.n_epochs * steps_per_epoch(examples, hyperparameters.batch_size)


def batch_indices(examples: int, hyperparameters: Hyperparameters, step: int) -> list[int]:
    """The examples of 0-based `step`."""
    per_epoch = steps_per_epoch(examples, hyperparameters.batch_size)
    epoch, index = divmod(step, per_epoch)
    order = list(range(examples))
    random.Random(hyperparameters.seed * 100_003 + epoch).shuffle(order)
    size = hyperparameters.batch_size
    return order[index * size: (index + 1) * size]
