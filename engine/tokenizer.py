"""The base model's tokenizer (tokenizer.json) and chat template (tokenizer_config.json)."""

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """Hugging Face's `tojson` for chat templates (jinja2's own escapes <, > and & for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def eos_token_ids(model_dir: Path, hf_config: dict, tokenizer: "Tokenizer | None") -> tuple[int, ...]:
    """Every token id that ends a completion: from config.json, generation_config.json and the tokenizer."""
    ids = set()
    sources = [hf_config.get("eos_token_id")]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.token_to_id(tokenizer.eos_token))
    for value in sources:
        ids |= set(value if isinstance(value, list) else [value] if value is not None else [])
    return tuple(sorted(ids))


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        legacy_file = model_dir / "chat_template.json"  # a vision-language processor's, before transformers 5
        if template is None and legacy_file.exists():
            template = json.loads(legacy_file.read_text()).get("chat_template")
        self.chat_template = template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if template else None
        if self._template is not None:  # a dict, not jinja2's ChainMap over env.globals (fixed from here on):
            self._template.globals = dict(self._template.globals)  # each render's context costs half as much

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def token_to_id(self, token: str | None) -> int | None:
        return self.hf.token_to_id(token) if token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` if the tokenizer has it as one special token (which plain text never matches)."""
        token = self.hf.token_to_id(text)
        if token is None:
            return None
        added = self.hf.get_added_tokens_decoder().get(token)
        return token if added is not None and added.special else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        """len(encode(text)) for about a fifth less CPU: a batch of one is encoded on this thread (rayon splits
        nothing) without the character offsets `encode` computes, and the GIL is released meanwhile."""
        return len(self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0])

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        if self._template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def stream(self, prompt_token_ids: list[int], *, skip_special_tokens: bool) -> "TextStream":
        return TextStream(self, prompt_token_ids, skip_special_tokens=skip_special_tokens)


class TextStream:
    """Incremental detokenization of one sequence's output, primed with the end of its prompt so
    that the first tokens decode with their leading spaces."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-4:], skip_special_tokens=skip_special_tokens)
        self.text = ""

    def push(self, token_id: int) -> str:
        chunk = self.stream.step(self.tokenizer.hf, token_id) or ""
        self.text += chunk
        return chunk
