"""Grammars for constrained decoding with llguidance (docs/structured-output.md): what a request asks
(`GrammarSpec`), compiled once per (tokenizer, grammar) into a `Grammar` kept in a bounded LRU cache, and each
sequence's own matcher, a copy of the compiled one.

Compiling happens before a request joins a batch (the server runs it in a thread; llguidance drops the GIL), so
its time is never part of a step, nor of any other request's GPU time. No torch."""

import collections
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import llguidance
from tokenizers import Tokenizer as HFTokenizer

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema or grammar larger than this is refused before compiling
MAX_COMPILE_SECONDS = 2.0  # a compile that took longer is refused (and not cached): the fuel limits below
# stop most such grammars much sooner
LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, max_lexer_states=50_000)
# OpenAI answers compact JSON; a grammar that allows free whitespace lets a weak model fill max_tokens with it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The client's schema or grammar cannot be used: a 400 naming the request parameter it came from."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """An output constraint as llguidance text (a JSON schema or a Lark grammar), and the request parameter it
    came from (errors name it)."""

    kind: str  # "json_schema" | "lark"
    text: str
    param: str

    @classmethod
    def json_schema(cls, schema: dict, *, param: str) -> "GrammarSpec":
        if not isinstance(schema, dict):
            raise GrammarError(f"{param} must be a JSON schema object", param=param)
        return cls(kind="json_schema", text=json.dumps(schema, separators=(",", ":")), param=param)  # keeps key order

    @classmethod
    def lark(cls, grammar: str, *, param: str) -> "GrammarSpec":
        return cls(kind="lark", text=grammar, param=param)

    def llguidance_grammar(self) -> str:
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


class Grammar:
    """A compiled grammar: `matcher()` hands each sequence its own copy in the start state."""

    def __init__(self, matcher: llguidance.LLMatcher, *, mask_vocab_size: int, compile_ms: float) -> None:
        self._pristine = matcher
        self.mask_vocab_size = mask_vocab_size  # tokens a mask of its matchers covers
        self.compile_ms = compile_ms

    def matcher(self) -> llguidance.LLMatcher:
        return self._pristine.deep_copy()


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer, caching the `capacity` most recently used (thread-safe: the
    server compiles in worker threads while the engine thread steps)."""

    def __init__(self, tokenizer_json: Path, *, vocab_size: int, eos_token_ids: tuple[int, ...],
                 capacity: int = 256, max_compile_seconds: float = MAX_COMPILE_SECONDS,
                 limits: dict[str, int] | None = None) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = capacity
        self.max_compile_seconds = max_compile_seconds
        self.limits = llguidance.LLParserLimits(**(LIMITS | (limits or {})))
        self.hits = self.misses = 0
        self._cache: collections.OrderedDict[tuple[str, str], Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, on first use: about a second for a large one)."""
        with self._lock:
            if self._tokenizer is None:
                text = self.tokenizer_json.read_text()
                words = HFTokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
                # masks cover the model's rows (often padded past the tokenizer's words)
                self._tokenizer = llguidance.LLTokenizer(text, eos_token=self.eos_token_ids,
                                                         n_vocab=max(self.vocab_size, words))
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Grammar:
        key = (spec.kind, spec.text)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return grammar
        if len(spec.text.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{spec.param} is too large: {len(spec.text.encode())} bytes, at most "
                               f"{MAX_GRAMMAR_BYTES}", param=spec.param)
        try:
            tokenizer = self.tokenizer
        except ValueError as error:  # a tokenizer llguidance cannot read (e.g. one without a decoder)
            raise GrammarError(f"{spec.param} cannot be used with this model: its tokenizer does not support "
                               f"constrained decoding ({error})", param=spec.param) from error
        started = time.perf_counter()
        try:
            text = spec.llguidance_grammar()
        except ValueError as error:
            raise GrammarError(f"{spec.param} is not valid: {error}", param=spec.param) from error
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self.limits)
        # the first mask builds the lexer's start state: part of compiling, and a check that the model can write
        # anything at all that the grammar allows (a word-level vocabulary cannot write JSON)
        first = matcher.compute_bitmask() if not matcher.is_error() else b""
        seconds = time.perf_counter() - started
        if matcher.is_error():
            raise GrammarError(f"{spec.param} cannot be used: {_short(matcher.get_error())}", param=spec.param)
        if not any(first):
            raise GrammarError(f"{spec.param} cannot be used with this model: no token of its vocabulary starts "
                               f"an output the grammar allows", param=spec.param)
        if seconds > self.max_compile_seconds:
            raise GrammarError(f"{spec.param} is too complex: compiling it took {seconds:.3f} s, the limit is "
                               f"{self.max_compile_seconds} s", param=spec.param)
        grammar = Grammar(matcher, mask_vocab_size=tokenizer.vocab_size, compile_ms=seconds * 1000.0)
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return grammar

    def state(self) -> dict:
        return {"cached": len(self._cache), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}


def _short(message: str, limit: int = 500) -> str:
    """llguidance's error, first line, bounded (its verbose errors can quote the whole grammar)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first if len(first) <= limit else first[:limit] + "..."
