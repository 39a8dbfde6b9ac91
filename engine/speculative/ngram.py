"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last
n tokens (n from MAX_N down to MIN_N), in its own prompt and output. No model; no torch."""

from engine.sequence import Sequence

MAX_N = 4
MIN_N = 2


class NgramIndex:
    """For one sequence: n-gram -> the position just after its latest occurrence, grown as tokens come."""

    def __init__(self) -> None:
        self.latest: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `latest`

    def extend(self, tokens: list[int]) -> None:
        # an n-gram ending at `end` (exclusive) is indexed once a token follows it
        for end in range(max(self.num_indexed, MIN_N), len(tokens)):
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self.latest[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(MAX_N, len(tokens)), MIN_N - 1, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramProposer:
    def __init__(self) -> None:
        self.indexes: dict[int, NgramIndex] = {}  # seq_id -> its index

    def propose(self, seqs: list[Sequence], lookahead: dict[int, int]) -> tuple[dict[int, list[int]], dict]:
        """seq_id -> at most lookahead[seq_id] proposed tokens (none when the suffix was never seen); their
        distributions are one-hot (no second dict entry)."""
        proposals = {}
        for seq in seqs:
            k = lookahead.get(seq.seq_id, 0)
            if k == 0:
                continue
            index = self.indexes.setdefault(seq.seq_id, NgramIndex())
            index.extend(seq.token_ids)  # the suffix itself is not indexed: no token follows it yet
            tokens = index.lookup(seq.token_ids, k)
            if tokens:
                proposals[seq.seq_id] = tokens
        return proposals, {}

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
