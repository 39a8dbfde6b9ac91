"""Token ids to text, for log-probabilities (the engine reports ids): the base model's own tokenizer.json."""

import functools
from pathlib import Path

from tokenizers import Tokenizer


@functools.lru_cache(maxsize=8)
def _tokenizer(checkpoint_dir: str) -> Tokenizer | None:
    path = Path(checkpoint_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def token_decoder(checkpoint_dir: str):
    tokenizer = _tokenizer(checkpoint_dir)

    def text(token_id: int) -> str:
        if tokenizer is None:
            return f"<token {token_id}>"
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text
