"""Who is calling and what they asked for: the key (by prefix, briefly cached), its tenant's plan, and the model
resolved for that tenant. Blocking (database reads), and `authorize`, the same from the event loop: the cache first, else one lookup in a
thread per key and model however many requests wait for it."""

import asyncio
import functools
import hashlib
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from asgiref.sync import sync_to_async
from django.utils import timezone
from rest_framework_api_key.crypto import split

from apikeys import auth_changes
from apikeys.models import ApiKey, Scope
from apikeys.selectors import KeyRefused, api_key_authenticate
from gateway.admission import Limits
from gateway.connections import checked_connection
from gateway.errors import ApiError
from gateway.hot_settings import hot
from gateway.request_guard import model_name_check
from metering.pricing import Rates, plan_rates, request_price
from registry.selectors import ModelNotFound, ResolvedModel, model_resolve, models_for_tenant
from registry.storage import adapter_store_root, canonical_urls
from tenancy.audit import Actor
from tenancy.authority import actor_role
from tenancy.models import Membership
from tenancy.roles import role_at_least


@dataclass(frozen=True)
class Target:
    """A resolved model: what the engine needs to serve it."""

    name: str  # as the client wrote it
    base_model: str
    checkpoint_dir: str
    max_context: int
    adapter_id: int | None
    adapter_version_id: int | None
    adapter_version: int | None
    digest: str | None
    adapter_path: str | None
    created: int = 0  # Unix seconds: the base model's registration, the adapter's creation, a pinned version's upload

    @functools.cached_property
    def engine_adapter(self) -> dict | None:
        """The generate request's "adapter" (engine.contract): signed GET URLs of its files where the storage signs
        them (S3: engines download it themselves), else the folder engines read it from. Signed once per target, on
        first use (about 0.5 ms a URL, not paid by a model listing): a target lives at most QUILT_KEY_CACHE_SECONDS,
        well inside the URLs' lifetime."""
        if self.digest is None:
            return None
        urls = canonical_urls(digest=self.digest)
        if urls is not None:
            return {"digest": self.digest, "urls": urls}
        return {"digest": self.digest, "path": self.adapter_path}


@dataclass(frozen=True)
class Caller:
    key_id: int | str
    tenant_id: int
    tenant_slug: str
    limits: Limits
    default_max_tokens: int
    weight: float
    rates: Rates  # the plan's, per million tokens
    model_rates: dict[str, Rates]  # the plan's per-base-model overrides
    allowed_models: tuple[str, ...]
    expires_at: datetime | None
    body_retention_days: int = 0  # the tenant keeps prompts and completions this long (0: metadata only)

    def rates_for(self, base_model: str) -> Rates:
        """The plan's rates for a base model: its override, else the plan's own."""
        return self.model_rates.get(base_model, self.rates)

    def spend(self, *, base_model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
        """What metering will bill for these counts: the same price function, the same rates."""
        return request_price(
            rates=self.model_rates.get(base_model, self.rates), prompt_tokens=prompt_tokens,  # `rates_for` inline
            cached_tokens=cached_tokens, completion_tokens=completion_tokens,
        )  # fmt: skip

    def may_use(self, name: str) -> bool:
        return not self.allowed_models or name in self.allowed_models or name.partition("@")[0] in self.allowed_models


# The one cache of verified callers (by a hash of the whole presented key), and resolved models, each kept for at
# most QUILT_KEY_CACHE_SECONDS. Any committed change to a key, tenant, plan, membership, price or model clears both
# at once in every process (apikeys.auth_changes, gateway.receivers); a lookup that started before a change does not
# store its result after it.
_callers: dict[bytes, tuple[float, Caller]] = {}
_targets: dict[tuple[int, str], tuple[float, Target]] = {}
_lock = threading.Lock()
_generation = 0  # bumped by every announced change
_listener: threading.Thread | None = None


def _forget_callers() -> None:
    global _generation
    with _lock:
        _generation += 1
        _callers.clear()
        _targets.clear()


def _listening() -> None:
    global _listener
    if _listener is None:
        with _lock:
            if _listener is None:
                _listener = auth_changes.listen(_forget_callers) or threading.current_thread()


def _digest(authorization: str) -> bytes:
    return hashlib.sha256(authorization.encode()).digest()


def _fresh(entry: tuple[float, object] | None) -> bool:
    return entry is not None and time.monotonic() - entry[0] < hot.QUILT_KEY_CACHE_SECONDS


def cached_caller_and_target(*, authorization: str, model: str | None) -> tuple[Caller, Target | None] | None:
    """The caller and model as verified and resolved less than a cache lifetime ago, without a database read;
    None when either must be looked up (and any refusal is left to that lookup). `_digest` and `_fresh` written
    out: this runs on every request."""
    entry = _callers.get(hashlib.sha256(authorization.encode()).digest())
    now, lifetime = time.monotonic(), hot.QUILT_KEY_CACHE_SECONDS
    if entry is None or now - entry[0] >= lifetime:
        return None
    caller = entry[1]
    if caller.expires_at is not None and caller.expires_at <= timezone.now():
        return None
    if not isinstance(model, str) or not model:
        return caller, None
    target = _targets.get((caller.tenant_id, model))
    if caller.allowed_models and not caller.may_use(model) or target is None or now - target[0] >= lifetime:
        return None
    return caller, target[1]


def _target(resolved: ResolvedModel, name: str) -> Target:
    version = resolved.version
    digest = version.digest if version is not None else None
    return Target(
        name=name,
        base_model=resolved.base_model.name,
        checkpoint_dir=resolved.base_model.checkpoint_dir,
        max_context=resolved.base_model.max_context,
        adapter_id=resolved.adapter.pk if resolved.adapter is not None else None,
        adapter_version_id=version.pk if version is not None else None,
        adapter_version=version.number if version is not None else None,
        digest=digest,
        adapter_path=str(adapter_store_root() / digest) if digest else None,
        created=int(_created(resolved, pinned="@" in name).timestamp()),
    )


def _created(resolved: ResolvedModel, *, pinned: bool) -> datetime:
    if resolved.adapter is None:
        return resolved.base_model.created_at
    return resolved.version.created_at if pinned else resolved.adapter.created_at


def presented_key_prefix(authorization: str) -> str:
    """The public prefix of the key an Authorization header presents ("Bearer <prefix>.<secret>"), or "" when it
    presents none in that form: what may be logged of a key that was not accepted, never its secret."""
    scheme, _, presented = authorization.partition(" ")
    prefix, secret = split(presented.strip())
    if scheme.lower() != "bearer" or not secret or not (prefix.isascii() and prefix.isalnum()) \
            or len(prefix) > ApiKey._meta.get_field("prefix").max_length:
        return ""
    return prefix


def caller_authenticate(*, authorization: str) -> tuple[Caller, ApiKey]:
    _listening()
    generation, started = _generation, time.monotonic()
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise ApiError(
            401,
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="invalid_api_key",
        )
    try:
        key = api_key_authenticate(presented=presented.strip())
    except KeyRefused as refused:
        status = 403 if refused.code == "tenant_suspended" else 401
        raise ApiError(status, refused.reason, code=refused.code) from None
    if not key.has_scope(Scope.INFERENCE):
        raise ApiError(403, "This API key does not have the 'inference' scope.", code="insufficient_scope")
    role = actor_role(actor=Actor(key=key), tenant=key.tenant)  # capped by its creator's role now
    if role is None or not role_at_least(role, Membership.Role.DEVELOPER):
        raise ApiError(403, "The member who made this API key no longer has a role that allows inference.",
                       code="insufficient_role")  # fmt: skip
    plan = key.tenant.plan
    rates, model_rates = plan_rates(plan=plan)
    caller = Caller(
        key_id=key.pk,
        tenant_id=key.tenant_id,
        tenant_slug=key.tenant.slug,
        limits=Limits.of_plan(plan, key),
        default_max_tokens=plan.default_max_tokens,
        weight=float(plan.scheduling_weight),
        rates=rates,
        model_rates=model_rates,
        allowed_models=tuple(key.allowed_models or ()),
        expires_at=key.expiry_date,
        body_retention_days=key.tenant.request_body_retention_days,
    )
    with _lock:
        if len(_callers) > 10_000:
            _callers.clear()
        if generation == _generation:  # else a change landed while this lookup ran: don't keep what it read
            _callers[_digest(authorization)] = (started, caller)
    return caller, key


def target_resolve(*, key: ApiKey, caller: Caller, name: str) -> Target:
    _listening()
    generation = _generation
    if not caller.may_use(name):
        refused = ApiError(403, f"This API key is not allowed to use the model '{name}'.", code="model_not_allowed", param="model")
        refused.caller = caller
        raise refused
    cache_key = (caller.tenant_id, name)
    hit = _targets.get(cache_key)
    if _fresh(hit):
        return hit[1]
    try:
        target = _target(model_resolve(tenant=key.tenant, name=name), name)
    except ModelNotFound as missing:
        refused = ApiError(404, missing.message, code="model_not_found", param="model")
        refused.caller = caller
        raise refused from None
    with _lock:
        if len(_targets) > 10_000:
            _targets.clear()
        if generation == _generation:  # else a change landed while this lookup ran: don't keep what it read
            _targets[cache_key] = (time.monotonic(), target)
    return target


@checked_connection  # the executor threads keep their connections between requests, outside Django's request cycle
def caller_and_target(*, authorization: str, model: str | None) -> tuple[Caller, Target | None]:
    model_name_check(model)
    caller, key = caller_authenticate(authorization=authorization)
    if not isinstance(model, str) or not model:
        return caller, None
    return caller, target_resolve(key=key, caller=caller, name=model)


@checked_connection
def caller_models(*, authorization: str) -> tuple[Caller, list[Target]]:
    caller, key = caller_authenticate(authorization=authorization)
    targets = [_target(resolved, resolved.name) for resolved in models_for_tenant(tenant=key.tenant)]
    return caller, [t for t in targets if caller.may_use(t.name)]


_lookup = sync_to_async(caller_and_target, thread_sensitive=False)
# Lookups running now, by what they look up. When a key's cache entry lapses or a change clears the cache, every
# request then in flight with that key would read the database at once (50 concurrent streams: 50 lookups of ~5 ms of
# CPU each); instead one reads it and the others wait for it, then take its result from the cache.
_looking_up: dict[tuple[str, object], asyncio.Future] = {}


async def authorize(*, authorization: str, model: str | None) -> tuple[Caller, Target | None]:
    """`caller_and_target` from the event loop: the cached answer, else the database's (ApiError if refused)."""
    cached = cached_caller_and_target(authorization=authorization, model=model)
    if cached is not None:
        return cached
    loop, what = asyncio.get_running_loop(), (authorization, model if isinstance(model, str) else None)
    running = _looking_up.get(what)
    if running is not None and running.get_loop() is loop:
        await asyncio.shield(running)  # it never fails: its outcome is the cache's
        cached = cached_caller_and_target(authorization=authorization, model=model)
        return cached or await _lookup(authorization=authorization, model=model)  # refused (never cached) or changed
    done = _looking_up[what] = loop.create_future()
    try:
        return await _lookup(authorization=authorization, model=model)
    finally:
        if _looking_up.get(what) is done:
            del _looking_up[what]
        done.set_result(None)
