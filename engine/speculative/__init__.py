"""Speculative decoding: n-gram and draft-model proposers, exact verification, an adaptive on/off policy."""
