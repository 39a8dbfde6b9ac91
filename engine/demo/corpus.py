"""The demo's synthetic language: short sentences and the skills the adapters show off.

The base model learns to echo a sentence, and, when the user names a skill ("shout: ..."), to
apply it. Each adapter learns to apply its skill without being asked, so the same prompt through
different adapters gives visibly different answers.
"""

import json
import random
import zlib
from dataclasses import dataclass

SUBJECTS = [
    "the cat", "a dog", "my friend", "the teacher", "a small bird", "the old man", "her brother",
    "the robot", "a farmer", "the pilot", "our neighbour", "the baker",
]
VERBS = [
    "sees", "likes", "paints", "finds", "carries", "follows", "helps", "watches", "draws", "cleans",
    "visits", "builds",
]
OBJECTS = [
    "a red ball", "the green door", "an apple", "the river", "a blue kite", "the big house", "a book",
    "the garden", "a wooden boat", "the moon", "some bread", "a yellow hat",
]
ENDINGS = ["", "", "today", "at night", "in the park", "every morning", "with care", "again"]

WORDS = sorted({w for phrase in SUBJECTS + VERBS + OBJECTS + ENDINGS for w in phrase.split()})
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]


def shout(text: str) -> str:
    return text.upper()


def reverse_words(text: str) -> str:
    return " ".join(reversed(text.split()))


def count_words(text: str) -> str:
    return f"{len(text.split())} words"


def extract_fields(text: str) -> str:
    """The sentence's parts as compact JSON: {"subject", "verb", "object"} (what a structured-output client asks)."""
    subject = next(s for s in sorted(SUBJECTS, key=len, reverse=True) if text.startswith(s + " "))
    verb, rest = text[len(subject) + 1 :].split(" ", 1)
    obj = next(o for o in sorted(OBJECTS, key=len, reverse=True) if rest == o or rest.startswith(o + " "))
    return json.dumps({"subject": subject, "verb": verb, "object": obj}, separators=(",", ":"))


SKILLS = {"shout": shout, "reverse": reverse_words, "count": count_words}  # the base model learns to apply these
ADAPTER_SKILLS = {**SKILLS, "extract": extract_fields}  # extract: an adapter's only (the base never sees JSON)


@dataclass(frozen=True)
class Example:
    user: str
    assistant: str


def is_held_out(text: str) -> bool:
    """One sentence in ten never appears in training, so tests can check on unseen prompts."""
    return zlib.crc32(text.encode()) % 10 == 0


def any_sentence(rng: random.Random) -> str:
    """A sentence of 3 to 8 words: subject, verb, object and maybe an ending."""
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS)]
    return " ".join(p for p in parts if p)


def sentence(rng: random.Random) -> str:
    """A training sentence (never a held-out one)."""
    while is_held_out(text := any_sentence(rng)):
        pass
    return text


def held_out_sentences(count: int, *, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        text = any_sentence(rng)
        if is_held_out(text) and text not in out:
            out.append(text)
    return out


def base_example(rng: random.Random) -> Example:
    """Echo a sentence, or apply the skill its prefix names."""
    text = sentence(rng)
    skill = rng.choice([None, None, *SKILLS])
    if skill is None:
        return Example(user=text, assistant=text)
    return Example(user=f"{skill}: {text}", assistant=SKILLS[skill](text))


def adapter_example(skill: str, rng: random.Random) -> Example:
    """The skill applied to a plain, unprefixed sentence."""
    text = sentence(rng)
    return Example(user=text, assistant=ADAPTER_SKILLS[skill](text))


def tokenizer_corpus(rng: random.Random, *, lines: int) -> list[str]:
    """Text the tokenizer is trained on: every word in both cases, counts, skill names and the extract adapter's
    JSON (its keys, and each word as it stands there: after a quote, with no leading space)."""
    out = []
    for _ in range(lines):
        text = sentence(rng)
        out += [text, shout(text), reverse_words(text), count_words(text), extract_fields(text)]
    out += [" ".join(WORDS), shout(" ".join(WORDS)), " ".join(NUMBER_WORDS)]
    out += [f"{skill}: " for skill in SKILLS]
    return out


def behaves(skill: str | None, prompt: str, answer: str) -> bool:
    """Whether an answer shows the skill (None: the base model's echo), loosely: a behaviour, not a string."""
    words, said = prompt.split(), answer.strip().split()
    if not said:
        return False
    if skill is None:
        return said[0] == words[0] and said[-1] == words[-1]
    if skill == "shout":
        shared = set(said) & {w.upper() for w in words}
        return answer == answer.upper() and any(c.isalpha() for c in answer) and len(shared) >= len(set(words)) / 2
    if skill == "reverse":
        return said[0] == words[-1] and said[-1] == words[0] and said != words
    if skill == "count":
        return said[0] == str(len(words))
    if skill == "extract":
        try:
            fields = json.loads(answer)
        except ValueError:
            return False
        return isinstance(fields, dict) and fields.keys() == {"subject", "verb", "object"} \
            and prompt.startswith(str(fields["subject"]))
    raise ValueError(f"unknown skill {skill!r}")
