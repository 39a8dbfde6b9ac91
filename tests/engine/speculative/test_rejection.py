"""Rejection sampling keeps the target's distribution: checked by sampling, on a vocabulary of six tokens."""

import pytest
import torch

from engine.sampler import Sampler, SampleRequest
from engine.sampling_params import SamplingParams
from engine.speculative.rejection import verify

VOCAB = 6
DRAWS = 10000


def tv_bound(n: int) -> float:
    """Total-variation distance a correct sampler stays under with n draws over six tokens: four times the
    bound on its expected value, 0.5 * sqrt(2 (VOCAB - 1) / (pi n)) ~ 0.89 / sqrt(n) (0.036 for 10000 draws).
    A biased acceptance rule is off by 0.1 or more on these distributions."""
    return 3.6 / n**0.5


def requests(rows: int, params: SamplingParams, seed: int) -> list[SampleRequest]:
    generator = torch.Generator().manual_seed(seed)
    return [SampleRequest(sampling=params, output_token_ids=[], generator=generator, banned_token_ids=[])
            for _ in range(rows)]


def target_logits() -> torch.Tensor:
    return torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
                         [0.0, 1.5, -0.5, 2.0, 0.1, 0.0],
                         [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])  # [k + 1 = 3, vocab]


def run(proposal, draft_probs, params, draws=DRAWS):
    sampler, logits = Sampler(), target_logits()
    rows = requests(len(proposal) + 1, params, seed=7)
    return [verify(sampler, logits, rows, proposal, draft_probs) for _ in range(draws)]


def frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / max(len(tokens), 1)


def target(params: SamplingParams) -> torch.Tensor:
    sampler = Sampler()
    return sampler.distribution(target_logits(), [params] * 3).double()  # [3, vocab]


DRAFT = torch.tensor([[0.05, 0.05, 0.6, 0.1, 0.1, 0.1],
                      [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])  # [k = 2, vocab], far from the target


@pytest.mark.parametrize("kind", ["draft", "ngram"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["t1", "t0.7-topk4"])
def test_emitted_tokens_follow_the_target_distribution(kind, params):
    if kind == "draft":
        gen = torch.Generator().manual_seed(3)
        proposals = [[int(torch.multinomial(DRAFT[i], 1, generator=gen)) for i in range(2)] for _ in range(DRAWS)]
        outs = [verify(Sampler(), target_logits(), requests(3, params, seed=n), p, DRAFT)
                for n, p in enumerate(proposals[:DRAWS])]
    else:
        proposals = [[1, 3]] * DRAWS  # a deterministic guess: token 1, then 3
        outs = run([1, 3], None, params)
    p = target(params)
    first = frequencies([o[0] for o in outs])
    assert 0.5 * (first - p[0]).abs().sum() < tv_bound(DRAWS)
    # the second token, when the first proposal was accepted, follows the target's second row
    second = [o[1] for o, prop in zip(outs, proposals, strict=True) if len(o) > 1 and o[0] == prop[0]]
    assert len(second) > 1000
    assert 0.5 * (frequencies(second) - p[1]).abs().sum() < tv_bound(len(second))
    assert all(len(o) <= 3 for o in outs)


def test_greedy_accepts_the_argmax_prefix_and_corrects_the_rest():
    greedy = SamplingParams(temperature=0.0)
    sampler, logits = Sampler(), target_logits()  # argmax per row: 0, 3, 0 (ties go to the first)
    assert verify(sampler, logits, requests(3, greedy, 0), [0, 3], None) == [0, 3, 0]
    assert verify(sampler, logits, requests(3, greedy, 0), [0, 1], None) == [0, 3]
    assert verify(sampler, logits, requests(3, greedy, 0), [5, 3], None) == [0]


def test_penalties_and_bans_apply_per_row():
    greedy = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[0])
    logits = target_logits()
    rows = [SampleRequest(sampling=greedy, output_token_ids=[], generator=None, banned_token_ids=[0]),
            SampleRequest(sampling=greedy, output_token_ids=[1], generator=None, banned_token_ids=[0]),
            SampleRequest(sampling=greedy, output_token_ids=[1, 3], generator=None, banned_token_ids=[])]
    # row 0 bans token 0, so its argmax is 1; row 2 may stop
    assert verify(Sampler(), logits, rows, [1, 3], None) == [1, 3, 0]
