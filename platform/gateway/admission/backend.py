"""The one interface both admission backends implement (Redis: `redis_backend`; the database: `db_backend`).

The rules, the same in both:
- a one-minute fixed window counts requests and (estimated, later corrected) tokens;
- each admitted request holds `tokens` and `spend` until it is settled or its hold expires (an orphan left by a
  crashed gateway); live holds are the concurrent requests;
- settled usage adds to the month's totals; a request is admitted only if settled + held + its own estimate stays
  within the budget and the spend limit. A refusal changes nothing.
- settling: a *final* settle carries the engine's counts and happens once per request id; a *provisional* one
  (a gateway whose stream broke before the engine's counts arrived) releases the hold but keeps its amount
  counted until the final one replaces it. A second provisional settle, or any settle after the final, is a no-op.
- a key with its own limits is checked in the same step: its window (RPM/TPM) and its month's spend + its live
  holds + this estimate against its budget; its holds are released and its month added to with the tenant's;
- a key's spend is counted exactly (picos) and belongs to its lineage (rotations keep it); `key_reconcile` sets it
  to metering's record of the lineage plus its provisional settles, as `reconcile` does for the tenant;
- `admit` is `acquire` where a backend may admit from a lease held ahead (Redis: `leases`); the lease it returns goes
  with the request's settle;
- a month total that is missing starts from metering's record; `reconcile` sets it to that record plus what is
  settled provisionally, unless settles landed meanwhile;
- a provisional settle may carry the usage event the client was served; it is kept until the final settle, and
  `unreported` lists those older than a grace period (their engine's event never came: the worker bills them).
"""

from typing import Protocol

from gateway.admission.limits import Decision, HeldTotals, Limits, Reconciled


class AdmissionBackend(Protocol):
    async def acquire(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> Decision: ...

    async def admit(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> tuple[Decision, object | None]: ...

    async def give_back_all(self) -> None: ...

    async def peek(self, *, tenant_id: int, key_prefix: str = "") -> Decision: ...

    async def settle(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "", lease: object | None = None,
    ) -> bool: ...  # fmt: skip

    def settle_sync(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "",
    ) -> bool: ...  # fmt: skip

    def key_totals(self, *, tenant_id: int, key_prefix: str) -> tuple[int, int]: ...

    def totals(self, *, tenant_id: int) -> HeldTotals: ...

    def reconcile(self, *, tenant_id: int) -> Reconciled | None: ...

    def key_reconcile(self, *, tenant_id: int, key_prefix: str) -> Reconciled | None: ...

    def unreported(self, *, tenant_id: int, older_than_seconds: float, limit: int) -> list[str]: ...

    def unreported_tenants(self) -> list[int]: ...
