"""Verification of proposed tokens against the target model, keeping the target's distribution exact.

Greedy rows accept a proposal while it equals the target's argmax, then emit the argmax. Sampled rows use
rejection sampling (Leviathan et al., 2023): proposal x drawn from q is accepted with probability
min(1, p(x) / q(x)); on the first rejection the token is drawn from norm(max(p - q, 0)) and the rest is
dropped; if all are accepted a bonus token is drawn from the last row's p. Every emitted token is then
distributed exactly as if the target had sampled it alone. A deterministic proposer (n-gram) has a
one-hot q, which reduces to: accept x with probability p(x), else draw from p with x removed.
"""

import torch

from engine.sampler import Sampler, SampleRequest


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [vocab] (exponential race, as the sampler draws)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: list[SampleRequest],
    proposal: list[int],
    draft_probs: torch.Tensor | None,
) -> list[int]:
    """Tokens to emit (the accepted prefix of `proposal`, then one more) for one sequence.

    logits [k + 1, vocab] float32: row i scores the token after the sequence plus proposal[:i];
    requests: k + 1 rows, row i's penalties and bans counting proposal[:i] as output;
    draft_probs [k, vocab]: the distribution each proposal was drawn from, None for a one-hot q.
    """
    adjusted = sampler.adjust(logits, requests)  # [k + 1, vocab]
    if requests[0].sampling.greedy:
        return accept_greedy(proposal, adjusted.argmax(dim=-1).tolist())
    return verify_sampled(sampler, adjusted, requests, proposal, draft_probs)


def accept_greedy(proposal: list[int], targets: list[int]) -> list[int]:
    """targets: the argmax of each of the k + 1 adjusted rows."""
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == targets[accepted]:
        accepted += 1
    return proposal[:accepted] + [targets[accepted]]


def verify_sampled(
    sampler: Sampler,
    adjusted: torch.Tensor,
    requests: list[SampleRequest],
    proposal: list[int],
    draft_probs: torch.Tensor | None,
) -> list[int]:
    """Rejection sampling over adjusted logits [k + 1, vocab] (penalties and bans applied)."""
    k = len(proposal)
    generator = requests[0].generator
    p = sampler.distribution(adjusted, [r.sampling for r in requests])  # [k + 1, vocab]
    if draft_probs is None:
        q = torch.zeros_like(p[:k]).scatter_(1, torch.tensor(proposal, device=p.device)[:, None], 1.0)  # [k, vocab]
    else:
        q = draft_probs
    index = torch.arange(k, device=p.device)
    token = torch.tensor(proposal, device=p.device)
    ratio = (p[index, token] / q[index, token]).clamp(max=1.0).tolist()  # [k]
    uniform = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    for i in range(k):
        if uniform[i] >= ratio[i]:
            residual = (p[i] - q[i]).clamp(min=0.0)  # [vocab]
            total = float(residual.sum())
            return proposal[:i] + [draw(residual / total if total > 0 else p[i], generator)]
    return proposal + [draw(p[k], generator)]
