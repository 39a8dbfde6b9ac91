"""Token counts of a prompt's long segments (the text between two special tokens) kept per tenant, so that a chat's
system prompt and earlier turns, sent again with every request, are tokenized once.

Exact because `tokenizers` first cuts a text at its added tokens that are matched before normalization (leftmost-
longest, without overlaps) and then normalizes, pre-tokenizes and encodes each piece between them on its own: a text
counts its added tokens, its pieces' tokens and what the post-processor adds to the whole. A stretch of the text that
begins and ends at such cuts therefore counts the same alone as inside the text. Used only where nothing else
breaks that: no truncation or padding, special tokens matched (`encode_special_tokens` off), no added token that
strips spaces or must stand alone as a word, and pre-tokenizers that treat each piece alike wherever it stands (not
Metaspace, whose prepend_scheme "first" looks at where a piece starts, nor ByteLevel's add_prefix_space). Other
tokenizers count each text whole (`Tokenizer.count`), and say so once in the log.

Kept per tenant: a count that comes back faster because another tenant sent the same segment would let one tenant
time-probe another's prompts (the engine salts its prefix cache by tenant for the same reason). Kept by a digest of
the segment, not its text: the gateway holds no prompt text past its request (a tenant may keep no bodies at all).
"""

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict

from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIN_CACHED_CHARS = 256  # shorter segments cost little more to encode than to look up; they are encoded in runs
_PIECEWISE_PRE_TOKENIZERS = frozenset({"Sequence", "Split", "Whitespace", "WhitespaceSplit", "Digits", "Punctuation",
                                       "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"})  # fmt: skip


def _piecewise(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        return not pre_tokenizer.get("add_prefix_space")
    if kind not in _PIECEWISE_PRE_TOKENIZERS:
        return False
    return all(_piecewise(part) for part in pre_tokenizer.get("pretokenizers", ()))


def cut_pattern(tokenizer: Tokenizer) -> re.Pattern | None:
    """The added tokens `tokenizers` cuts a text at, longest first (as its leftmost-longest matching picks), or None
    where the counts of the pieces may not add up to the text's."""
    hf = tokenizer.hf
    added = hf.get_added_tokens_decoder().values()
    if hf.truncation is not None or hf.padding is not None or hf.encode_special_tokens:
        return None
    if any(token.lstrip or token.rstrip or token.single_word for token in added):
        return None
    if not _piecewise(json.loads(hf.to_str()).get("pre_tokenizer")):
        return None
    cuts = sorted({token.content for token in added if not token.normalized}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, cuts))) if cuts else None


class SegmentCounts:
    """`count(text, tenant=..., add_special_tokens=...)` equals `tokenizer.count(text, ...)`: segments of
    MIN_CACHED_CHARS or more counted alone and kept (per tenant; `budget_chars` of them for all tenants together,
    least recently used dropped first), the rest of the text between them encoded a run at a time."""

    def __init__(self, tokenizer: Tokenizer, *, budget_chars: int, min_chars: int = MIN_CACHED_CHARS):
        self.tokenizer = tokenizer
        self.cuts = cut_pattern(tokenizer)
        if self.cuts is None:
            log.info("the tokenizer's pieces may not count alone as in the whole text: its prompts are counted whole")
        self.added = tokenizer.hf.num_special_tokens_to_add(False)  # the post-processor's, once per text
        self.min_chars, self.budget_chars = min_chars, budget_chars
        self._kept: OrderedDict[tuple[object, bytes], tuple[int, int]] = OrderedDict()  # -> (count, characters)
        self._kept_chars = 0
        self._lock = threading.Lock()  # prompts above QUILT_TOKENIZE_ABOVE_BYTES are counted on worker threads

    def count(self, text: str, *, tenant: object, add_special_tokens: bool = True) -> int:
        if self.cuts is None or len(text) < self.min_chars:
            return self.tokenizer.count(text, add_special_tokens=add_special_tokens)
        encode = self.tokenizer.count
        counted = self.added if add_special_tokens else 0
        run = 0  # where the text not counted yet starts: a long segment's end (a cut's start), or 0
        run_cuts, run_text = 0, False  # the cuts in that run; whether any of its segments has text
        start = 0  # where the current segment starts
        for cut in self.cuts.finditer(text):
            end = cut.start()
            if end - start >= self.min_chars:
                counted += (encode(text[run:start], add_special_tokens=False) if run_text else run_cuts)
                counted += self._segment(tenant, text[start:end])
                run, run_cuts, run_text = end, 0, False
            elif end > start:
                run_text = True
            run_cuts += 1
            start = cut.end()
        end = len(text)
        if end - start >= self.min_chars:
            counted += (encode(text[run:start], add_special_tokens=False) if run_text else run_cuts)
            return counted + self._segment(tenant, text[start:end])
        if end > start or run_text:
            return counted + encode(text[run:], add_special_tokens=False)
        return counted + run_cuts

    def _segment(self, tenant: object, segment: str) -> int:
        key = (tenant, hashlib.blake2b(segment.encode("utf-8", "surrogatepass"), digest_size=16).digest())
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept[0]
        counted = self.tokenizer.count(segment, add_special_tokens=False)
        with self._lock:
            if key not in self._kept:
                self._kept[key] = (counted, len(segment))
                self._kept_chars += len(segment)
                while self._kept_chars > self.budget_chars:
                    _, (_, dropped_chars) = self._kept.popitem(last=False)
                    self._kept_chars -= dropped_chars
        return counted
