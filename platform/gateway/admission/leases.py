"""Admission leases: a gateway process that admits one tenant's key often takes a share of its room ahead (requests
and tokens of the current minute, concurrency slots, and the month's budget and spend) in one hold, and admits
requests from that share in the process, with no round trip to Redis. Nothing else about admission changes:

- The share is held in Redis like a request's hold (`redis_scripts`, "Admission leases"), so every other process
  sees it as used, and no limit is ever exceeded: what one process admits from its lease, no other can.
- A lease is at most 1/SHARE of each limit's room, and is taken only where that is four requests of the one that asked
  (and two concurrency slots); nearer a limit each request is admitted alone, exactly as without leases. So a refusal is
  never late; it may come early by what other processes hold unused, and each gives that back after IDLE_SECONDS without
  a request, at the end of the minute, or when it needs a new lease.
- Each request admitted from a lease is still settled on its own, before its client reads [DONE]: its estimate
  leaves the lease's hold and what it used is counted (`gateway.exchange`), as for a request held alone.
- A process that dies leaves its lease to expire with the hold TTL, as it leaves its requests' holds.

The x-ratelimit-* headers of a request admitted from a lease report the window as the lease saw it, plus what the
process admitted from it since.
"""

import asyncio
import itertools
import os
import time
from typing import NamedTuple

from gateway.admission.limits import Decision, Limits

SHARE = 8  # a lease takes at most 1/SHARE of any limit's room (and of the free concurrency slots)
BUSY = 8  # a key's requests within a second, in one process, before that process leases for it
IDLE_SECONDS = 1.0  # a lease no request used for this long is given back
MAX_REQUESTS = 4096
MAX_SLOTS = 512
_MARGIN = 0.05  # a lease stops admitting this long before its window's end by the local clock (Redis's decides)

_counter = itertools.count(1)
_process: list = [0, ""]  # the pid the token was drawn in, and the token


def new_id() -> str:
    """A lease id no other process makes, on any machine: a random token of this process and a count. (A pid alone
    is not: every pod's workers may have the same ones. The token is drawn again in a forked child.)"""
    pid = os.getpid()
    if _process[0] != pid:
        _process[:] = [pid, os.urandom(8).hex()]
    return f"{_process[1]}.{next(_counter)}"


class Ticket(NamedTuple):
    """A request admitted from a lease: the lease, and the estimate it took from it."""

    lease: "Lease"
    tokens: int
    spend_micros: int
    picos: int


class Lease:
    """One lease of one tenant's key, in the process that took it. Counts what is left of it and what is in flight."""

    __slots__ = (
        "member", "limits", "window", "window_end", "deadline", "requests", "window_tokens", "budget_tokens",
        "spend", "picos", "slots", "in_flight", "seen_requests", "seen_tokens", "seen_key_requests", "seen_key_tokens",
        "keyed", "active", "used",
    )  # fmt: skip

    def __init__(
        self, *, lease_id: str, limits: Limits, window: int, reset_ms: int, n: int, c: int, tokens: int, spend: int,
        picos: int, counts: tuple[int, int, int, int], now: float,
    ):  # fmt: skip
        self.member, self.limits, self.window = "~" + lease_id, limits, window
        self.window_end = now + reset_ms / 1000.0
        self.deadline = self.window_end - _MARGIN
        self.keyed = bool(limits.key_prefix)
        # what is left of it, the request that took it admitted
        self.requests, self.window_tokens, self.budget_tokens = n - 1, (n - 1) * tokens, (n - 1) * tokens
        self.spend, self.picos = (n - 1) * spend, (n - 1) * picos if self.keyed else 0
        self.slots, self.in_flight = c, 1
        reqs, toks, key_reqs, key_toks = counts  # the window's, before the lease
        self.seen_requests, self.seen_tokens = reqs + 1, toks + tokens
        self.seen_key_requests, self.seen_key_tokens = key_reqs + 1, key_toks + tokens
        self.active, self.used = True, now

    def admit(self, tokens: int, spend: int, picos: int, now: float) -> Decision | None:
        """The request admitted from what is left, or None (the caller asks Redis)."""
        if (
            now >= self.deadline or self.requests < 1 or self.in_flight >= self.slots or self.window_tokens < tokens
            or self.budget_tokens < tokens or self.spend < spend or (self.keyed and self.picos < picos)
        ):  # fmt: skip
            return None
        self.requests -= 1
        self.window_tokens -= tokens
        self.budget_tokens -= tokens
        self.spend -= spend
        if self.keyed:
            self.picos -= picos
        self.in_flight += 1
        self.used = now
        self.seen_requests += 1
        self.seen_tokens += tokens
        reset_ms = int((self.window_end - now) * 1000)
        if not self.keyed:
            return Decision(True, "ok", self.seen_requests, self.seen_tokens, reset_ms)
        self.seen_key_requests += 1
        self.seen_key_tokens += tokens
        return Decision(True, "ok", self.seen_requests, self.seen_tokens, reset_ms, self.seen_key_requests,
                        self.seen_key_tokens)  # fmt: skip

    def give_back(self) -> list:
        """LEASE_RETURN's arguments (`redis_scripts.lease_return`): what is unused, and the slots its requests in
        flight keep. The lease admits nothing more."""
        self.active = False
        return [
            self.member, self.window, self.limits.key_prefix, self.requests, self.window_tokens, self.budget_tokens,
            self.spend, self.picos, self.slots, self.in_flight,
        ]  # fmt: skip

    def settled(self, ticket: Ticket, tokens: int) -> list:
        """The settle's lease arguments (SETTLE's ARGV[8..15]) for one of its requests, which counted `tokens`."""
        self.in_flight -= 1
        if self.active:  # its window's tokens stay the lease's to use, corrected by what the request used
            self.window_tokens += ticket.tokens - tokens
            return [self.member, ticket.tokens, ticket.spend_micros, ticket.picos, "", 0, "", 0]
        left = self.in_flight
        slot = f"{self.member}.{left}" if left else ""
        return [self.member, ticket.tokens, ticket.spend_micros, ticket.picos, slot, int(not left), self.window,
                tokens - ticket.tokens]  # fmt: skip


class Demand:
    """One tenant's key in one process: its lease, and how many requests it had this second and the last."""

    __slots__ = ("lease", "renewing", "second", "count", "last_count", "peak")

    def __init__(self):
        self.lease: Lease | None = None
        self.renewing = False
        self.second, self.count, self.last_count, self.peak = 0, 0, 0, 0

    def note(self, now: float, in_flight: int) -> bool:
        """Counts a request; whether the key is busy enough here for a lease."""
        second = int(now)
        if second != self.second:
            self.last_count = self.count if second == self.second + 1 else 0
            self.second, self.count, self.peak = second, 0, 0
        self.count += 1
        self.peak = max(self.peak, in_flight)
        return self.count >= BUSY or self.last_count >= BUSY

    def wants(self) -> tuple[int, int]:
        """The lease to ask for: two seconds of this key's requests here, and twice its requests in flight."""
        requests = min(MAX_REQUESTS, max(16, 2 * max(self.count, self.last_count)))
        return requests, min(MAX_SLOTS, max(4, 2 * self.peak + 2))


class Leases:
    """A process's leases on one event loop, by tenant and key lineage; gives back the idle ones."""

    def __init__(self, give_back):
        self.demands: dict[tuple[int, str], Demand] = {}
        self._give_back = give_back  # async (tenant id, lease arguments) -> None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def demand(self, tenant_id: int, key_prefix: str) -> Demand:
        demand = self.demands.get((tenant_id, key_prefix))
        if demand is None:
            demand = self.demands[(tenant_id, key_prefix)] = Demand()
        return demand

    def keep(self) -> None:
        """Looks for idle leases every half second while any is held."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(IDLE_SECONDS / 2, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now, held = time.monotonic(), False
        for key, demand in list(self.demands.items()):
            lease = demand.lease
            if lease is not None and (now - lease.used >= IDLE_SECONDS or now >= lease.deadline):
                demand.lease = None
                self.send(key[0], lease.give_back())
            elif lease is None and now - demand.second > 60:
                del self.demands[key]
            held = held or demand.lease is not None
        if held:
            self.keep()

    def send(self, tenant_id: int, arguments: list) -> None:
        task = asyncio.get_running_loop().create_task(self._give_back(tenant_id, arguments))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def give_back_all(self) -> list[tuple[int, list]]:
        """Every lease's tenant and return arguments, the leases ended (at shutdown)."""
        back = []
        for (tenant_id, _), demand in self.demands.items():
            if demand.lease is not None:
                back.append((tenant_id, demand.lease.give_back()))
                demand.lease = None
        return back
