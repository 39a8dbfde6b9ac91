"""The adaptive policy (speculation off when it does not pay) and the n-gram proposer, without a model."""

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.ngram import NgramProposer
from engine.speculative.policy import FIRST_BACKOFF, SpeculationPolicy


def seq(tokens: list[int], max_tokens: int = 100, prompt: int = 1) -> Sequence:
    s = Sequence(request_id="r", index=0, prompt_token_ids=tokens[:prompt], sampling=SamplingParams(max_tokens=max_tokens),
                 adapter=None, tenant="t", weight=1.0, cache_salt="t", arrival_time=0.0)
    s.token_ids = list(tokens)
    return s


def policy(**overrides) -> SpeculationPolicy:
    return SpeculationPolicy(**{"num_tokens": 4, "max_batch": 8, "min_acceptance": 0.3, "max_model_len": 64, **overrides})


def steps_off(p: SpeculationPolicy, s: Sequence) -> int:
    offs = 0
    while p.lookahead(s, batch_size=2) == 0:
        offs += 1
    return offs


def test_low_acceptance_turns_a_sequence_off_then_it_probes_again_later():
    p, s, other = policy(), seq([5, 6, 7]), seq([5, 6, 7])
    assert p.lookahead(s, batch_size=2) == 4
    p.record(s, proposed=4, accepted=0)
    assert steps_off(p, s) == 2 * FIRST_BACKOFF  # alone, a probe waits twice its backoff
    p.record(s, proposed=4, accepted=0)  # the probe fails too: twice as long off
    p.record(other, proposed=4, accepted=4)  # another sequence speculates: the probe rides along
    assert steps_off(p, s) == 2 * FIRST_BACKOFF
    p.record(s, proposed=4, accepted=4)  # a good probe: it stays on
    assert p.lookahead(s, batch_size=1) == 4
    p.record(s, proposed=4, accepted=1)  # one weak step in a good run does not turn it off (EMA 0.625)
    assert p.lookahead(s, batch_size=1) == 4


def test_new_sequences_start_off_while_the_engine_wide_acceptance_is_low():
    p = policy()
    for _ in range(3):
        s = seq([5, 6, 7])
        p.lookahead(s, batch_size=1)
        p.record(s, proposed=4, accepted=0)
        p.release(s)
    assert p.lookahead(seq([5, 6, 7]), batch_size=1) == 0


def test_large_batches_and_the_end_of_a_request_get_no_lookahead():
    p = policy()
    assert p.lookahead(seq([5, 6, 7]), batch_size=9) == 0  # compute-bound
    assert p.lookahead(seq([5, 6, 7]), batch_size=8) == 4
    assert p.lookahead(seq([5, 6, 7], max_tokens=3, prompt=1), batch_size=1) == 0  # 2 of 3 emitted: 1 to sample
    assert p.lookahead(seq([5, 6, 7], max_tokens=5, prompt=1), batch_size=1) == 2
    assert p.lookahead(seq(list(range(62)), prompt=1), batch_size=1) == 1  # max_model_len 64


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer()
    s = seq([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 2, 3])
    tokens, probs = proposer.propose([s], {s.seq_id: 3})
    assert tokens == {s.seq_id: [7, 8, 2]} and probs == {}  # "2 3" last followed by 7, not by 4
    s.token_ids += [7, 5]
    assert proposer.propose([s], {s.seq_id: 3})[0] == {}  # "7 5" never seen
    s.token_ids += [1, 2, 3, 4]
    assert proposer.propose([s], {s.seq_id: 2})[0] == {s.seq_id: [9, 1]}  # the 4-gram "1 2 3 4" wins
    assert proposer.propose([s], {s.seq_id: 0})[0] == {}
