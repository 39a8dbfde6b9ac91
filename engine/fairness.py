"""Who is admitted next: first-come-first-served, or fair share between tenants. No torch.

VirtualTokenCounter follows VTC (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024): each tenant's counter grows by the tokens served to it divided by the request's
weight; the waiting request of the tenant with the smallest counter goes first; a tenant that
comes back after being idle is lifted to the smallest active counter, so it cannot bank credit.
"""

from engine.sequence import Sequence


class FirstComeFirstServed:
    def on_arrival(self, seq: Sequence, active_tenants: set[str]) -> None:
        pass

    def pick(self, candidates: list[Sequence]) -> Sequence:
        return candidates[0]

    def on_served(self, seq: Sequence, *, prompt_tokens: int, completion_tokens: int) -> None:
        pass


class VirtualTokenCounter:
    def __init__(self, *, prompt_token_cost: float = 1.0, completion_token_cost: float = 1.0) -> None:
        self.prompt_token_cost = prompt_token_cost
        self.completion_token_cost = completion_token_cost
        self.counters: dict[str, float] = {}

    def on_arrival(self, seq: Sequence, active_tenants: set[str]) -> None:
        counter = self.counters.get(seq.tenant, 0.0)
        if seq.tenant not in active_tenants:
            others = [self.counters.get(t, 0.0) for t in active_tenants]
            if others:
                counter = max(counter, min(others))
        self.counters[seq.tenant] = counter

    def pick(self, candidates: list[Sequence]) -> Sequence:
        # candidates are in queue order, so ties go to the earliest
        return min(candidates, key=lambda seq: self.counters.get(seq.tenant, 0.0))

    def on_served(self, seq: Sequence, *, prompt_tokens: int, completion_tokens: int) -> None:
        cost = prompt_tokens * self.prompt_token_cost + completion_tokens * self.completion_token_cost
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + cost / seq.weight
