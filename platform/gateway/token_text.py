"""Token ids to text and bytes, for log-probabilities and echoed token prompts (the engine reports ids): the base
model's own tokenizer.json.

A token's bytes are its own raw bytes, which for a byte-level BPE token may be part of one UTF-8 character (an
emoji is often 2-4 tokens): decoding such a token alone gives U+FFFD, whose bytes are not the token's. The tokenizers
library decodes only to text, so the byte-level alphabet (GPT-2's: each byte has one printable character) is
inverted here; SentencePiece's byte-fallback tokens (`<0xE2>`) carry their byte in the name."""

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class TokenPiece:
    text: str  # the token's text; a token that is not whole UTF-8 reads as its escaped bytes, e.g. "\\xe2\\x80"
    bytes: bytes
    whole: bool  # its bytes are valid UTF-8 on their own


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the others (controls, space,
    the 0x7F-0xA0 range and 0xAD) are shifted past 255 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(part) for part in decoder.get("decoders") or [])


class Vocabulary:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()} if tokenizer else {}
        self.byte_level = tokenizer is not None and _uses_byte_level(json.loads(tokenizer.to_str()).get("decoder"))

    def token_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"<token {token_id}>".encode()
        if token_id in self.added:  # special and added tokens: their own text (the end token as the model has it)
            return self.added[token_id].encode()
        name = self.tokenizer.id_to_token(token_id)
        if name is None:
            return b""
        if self.byte_level and all(c in _BYTE_LEVEL for c in name):
            return bytes(_BYTE_LEVEL[c] for c in name)
        if match := _BYTE_FALLBACK.match(name):
            return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def piece(self, token_id: int) -> TokenPiece:
        raw = self.token_bytes(token_id)
        try:
            return TokenPiece(text=raw.decode(), bytes=raw, whole=True)
        except UnicodeDecodeError:
            return TokenPiece(text="".join(f"\\x{b:02x}" for b in raw), bytes=raw, whole=False)

    def decode(self, token_ids: list[int]) -> str:
        """A token prompt as text, as the model reads it (special tokens included)."""
        if self.tokenizer is None:
            return "".join(f"<token {t}>" for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def vocabulary(checkpoint_dir: str) -> Vocabulary:
    path = Path(checkpoint_dir) / "tokenizer.json"
    return Vocabulary(Tokenizer.from_file(str(path)) if path.is_file() else None)
