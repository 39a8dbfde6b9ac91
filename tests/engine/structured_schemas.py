"""Random JSON schemas from a seeded RNG, and a tiny model to decode them with (tests and benchmarks/structured.py).

Every schema bounds what it allows (string lengths, array sizes, number ranges), so that a constrained output of a
random model ends well within a test's max_tokens."""

import random
import string

LEAVES = ("string", "integer", "number", "boolean", "enum", "nullable")


def random_schema(rng: random.Random, *, depth: int = 0) -> dict:
    """An object schema: nested objects and arrays, enums, bounded numbers, optional fields."""
    return _object(rng, depth)


def _value(rng: random.Random, depth: int) -> dict:
    kinds = LEAVES + (("object", "array") if depth < 2 else ())
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        low = rng.randint(0, 1)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 500), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, 42, "x y", True, None], rng.randint(1, 4))}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample([f"{w}_{c}" for w in ("id", "name", "size", "tags", "when", "ok") for c in string.ascii_lowercase[:3]],
                       rng.randint(1, 4))
    properties = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
