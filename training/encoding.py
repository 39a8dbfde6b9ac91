"""Examples as token ids through the base model's own chat template, the way the engine will prompt the model.

A conversation is cut where the template puts each assistant message: the text before it (what the engine
renders with the generation prompt) is context, the assistant's text up to its end-of-turn is learned. Each
piece is tokenized on its own, so a prompt's tokens are exactly the ones the engine will see. No torch here.
"""

from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from training.dataset import DatasetInvalid, Example, LineError, Message, PreferenceExample, SupervisedExample

IGNORE = -100  # label of a token that is not learned


@dataclass(frozen=True)
class SupervisedTokens:
    line: int
    input_ids: list[int]
    labels: list[int]  # IGNORE where the token is context

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class PreferenceTokens:
    line: int
    prompt_ids: list[int]
    preferred_ids: list[int]
    non_preferred_ids: list[int]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.preferred_ids) + len(self.non_preferred_ids)

    @property
    def longest(self) -> int:
        return len(self.prompt_ids) + max(len(self.preferred_ids), len(self.non_preferred_ids))


Encoded = SupervisedTokens | PreferenceTokens


class _Unsplittable(Exception):
    pass


def _render(tokenizer: Tokenizer, messages: tuple[Message, ...] | list[Message], *, generation: bool) -> str:
    plain = [{"role": m.role, "content": m.content} for m in messages]
    return tokenizer.apply_chat_template(plain, add_generation_prompt=generation)


def _after(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise _Unsplittable
    return text[len(prefix):]


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def _supervised(tokenizer: Tokenizer, example: SupervisedExample) -> SupervisedTokens:
    input_ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for index, message in enumerate(example.messages):
        if message.role != "assistant":
            continue
        prompt = _render(tokenizer, example.messages[:index], generation=True)
        answered = _render(tokenizer, example.messages[: index + 1], generation=False)
        context = _ids(tokenizer, _after(prompt, rendered))
        answer = _ids(tokenizer, _after(answered, prompt))
        input_ids += context + answer
        labels += [IGNORE] * len(context) + (answer if message.weight else [IGNORE] * len(answer))
        rendered = answered
    return SupervisedTokens(line=example.line, input_ids=input_ids, labels=labels)


def _preference(tokenizer: Tokenizer, example: PreferenceExample) -> PreferenceTokens:
    prompt = _render(tokenizer, example.messages, generation=True)

    def answer(content: str) -> list[int]:
        full = _render(tokenizer, [*example.messages, Message(role="assistant", content=content)], generation=False)
        return _ids(tokenizer, _after(full, prompt))

    return PreferenceTokens(
        line=example.line, prompt_ids=_ids(tokenizer, prompt), preferred_ids=answer(example.preferred),
        non_preferred_ids=answer(example.non_preferred),
    )  # fmt: skip


def encode(tokenizer: Tokenizer, examples: list[Example], *, max_tokens: int) -> list[Encoded]:
    """Token ids of every example; DatasetInvalid naming each line that is too long for the model's context
    (`max_tokens`) or that the chat template can't cut into context and answer."""
    encoded: list[Encoded] = []
    errors: list[LineError] = []
    for example in examples:
        try:
            tokens = _supervised(tokenizer, example) if isinstance(example, SupervisedExample) else _preference(
                tokenizer, example
            )
        except _Unsplittable:
            errors.append(LineError(example.line, "the base model's chat template can't separate the assistant's answer"))
            continue
        length = tokens.tokens if isinstance(tokens, SupervisedTokens) else tokens.longest
        if length > max_tokens:
            errors.append(LineError(
                example.line, f"the example is {length} tokens long; the model's context holds {max_tokens}"
            ))  # fmt: skip
            continue
        encoded.append(tokens)
    if errors:
        raise DatasetInvalid(errors)
    return encoded
