"""A stored file's examples as token ids for a base model: the same check when a job is created and when its
trainer starts, so the trainer never meets a line the job's creation did not accept."""

import functools
from pathlib import Path

from engine.tokenizer import Tokenizer
from finetuning import storage
from finetuning.models import TrainingFile
from training import dataset, encoding


@functools.lru_cache(maxsize=8)
def base_tokenizer(checkpoint_dir: str) -> Tokenizer:
    return Tokenizer(Path(checkpoint_dir))


def examples_encode(
    *, uploaded: TrainingFile, method: str, checkpoint_dir: str, max_context: int, minimum: int
) -> list[encoding.Encoded]:
    """DatasetInvalid naming each bad line when the file can't be trained on."""
    _, examples = dataset.parse(storage.file_read(key=uploaded.storage_key), method=method, minimum=minimum)
    return encoding.encode(base_tokenizer(checkpoint_dir), examples, max_tokens=max_context)
