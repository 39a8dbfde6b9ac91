"""`json.dumps(value, separators=(",", ":"))` for the hot path's own values, straight through the `json` module's C
encoder: `JSONEncoder.encode` reaches the same encoder through two Python frames and a new encoder object per call.
Without json.dumps' check for reference cycles: every value written here is a fresh tree of
dicts, lists, strings and numbers (a cycle would end in RecursionError instead of ValueError)."""

import json
from _json import make_encoder
from json.encoder import encode_basestring_ascii

# json.dumps' defaults: its `default` (TypeError for what JSON can't hold), ASCII escapes, no indent, no key sorting,
# no skipped keys, NaN allowed
_encode = make_encoder(None, json.JSONEncoder().default, encode_basestring_ascii, None, ":", ",", False, False, True)


def compact_json(value) -> str:
    return "".join(_encode(value, 0))
