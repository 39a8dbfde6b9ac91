"""From one step's logits to the next token of each sequence, plus the log-probabilities asked for."""

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """One row of logits to sample from, with what the sampler needs of its sequence."""

    sampling: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded sequences draw from their own generator
    banned_token_ids: list[int]  # stop tokens while min_tokens is not reached
    allowed: torch.Tensor | None = None  # [vocab] bool: the tokens its grammar allows next (None: unconstrained)
    prompt_token_ids: list[int] = field(default_factory=list)  # given where repetition_penalty needs them


@dataclass
class Sample:
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[Sample]:
        """logits [N, vocab] float32, one row per request."""
        token_ids = self._choose(self.adjust(logits, requests), requests)  # [N]
        return self.samples(logits, requests, token_ids.tolist())

    def adjust(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """A copy of logits [N, vocab] with each row's penalties and logit_bias applied, banned tokens and those its
        grammar forbids masked."""
        original, logits = logits, logits.clone()
        self._apply_penalties(logits, requests)
        for i, r in enumerate(requests):
            if r.sampling.logit_bias:
                ids = torch.tensor(list(r.sampling.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(r.sampling.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            if r.banned_token_ids:
                logits[i, r.banned_token_ids] = -float("inf")
        constrained = [i for i, r in enumerate(requests) if r.allowed is not None]
        if constrained:
            allowed = torch.stack([requests[i].allowed for i in constrained])  # [M, vocab]
            rows = logits[constrained].masked_fill(~allowed, -float("inf"))
            # a grammar that allows only what min_tokens bans (its end, once complete) ends the output anyway
            stuck = torch.isneginf(rows).all(dim=-1, keepdim=True)  # [M, 1]
            unbanned = original[constrained].masked_fill(~allowed, -float("inf"))
            logits[constrained] = torch.where(stuck, unbanned, rows)
        return logits

    @staticmethod
    def samples(logits: torch.Tensor, requests: list[SampleRequest], chosen: list[int]) -> list[Sample]:
        """Sample records of the chosen tokens, with the log-probabilities of the model's own distribution."""
        raw_logprobs = None
        if any(r.sampling.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [N, vocab], the model's own distribution
        samples = []
        for i, (r, token_id) in enumerate(zip(requests, chosen, strict=True)):
            logprob = top = None
            if r.sampling.logprobs is not None:
                logprob = float(raw_logprobs[i, token_id])
                if r.sampling.logprobs:
                    values, ids = raw_logprobs[i].topk(r.sampling.logprobs)
                    top = dict(zip(ids.tolist(), values.tolist(), strict=True))
            samples.append(Sample(token_id=token_id, logprob=logprob, top_logprobs=top))
        return samples

    def _apply_penalties(self, logits: torch.Tensor, requests: list[SampleRequest]) -> None:
        """repetition_penalty (as transformers and vLLM: over the prompt's and the output's tokens, a positive logit
        divided by it, a negative one multiplied), then frequency and presence penalties (OpenAI's, over the output)."""
        for i, r in enumerate(requests):
            s = r.sampling
            if s.repetition_penalty != 1.0 and (r.prompt_token_ids or r.output_token_ids):
                seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, device=logits.device).unique()
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / s.repetition_penalty, row * s.repetition_penalty)
            if not (s.presence_penalty or s.frequency_penalty) or not r.output_token_ids:
                continue
            ids = torch.tensor(r.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)  # [vocab]
            logits[i] -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(logits.dtype)

    def _choose(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)  # [N]
        rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not rows:
            return greedy
        probs = self.distribution(logits[rows], [requests[i].sampling for i in rows])  # [M, vocab]
        # exponential race: argmax(p / q) with q ~ Exp(1) draws from p; each seeded row draws its own q
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            if requests[i].generator is not None:
                noise[j].exponential_(generator=requests[i].generator)
        sampled = (probs / noise).argmax(dim=-1)
        greedy[rows] = sampled
        return greedy

    @staticmethod
    def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """What a sampled (not greedy) row draws from: adjusted logits [M, vocab] through temperature,
        top-k, top-p and min-p, as probabilities [M, vocab]."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        sub = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            k = torch.tensor([k or sub.shape[1] for k in top_k], device=device).clamp(max=sub.shape[1])
            kth = sub.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [M, 1]
            sub = sub.masked_fill(sub < kth, -float("inf"))
        probs = sub.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if (top_p < 1.0).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None]  # keeps the top token
            probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs
