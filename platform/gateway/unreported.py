"""Usage no engine reported: every served request's usage, as the engine's final event counted it, is kept with the
gateway's provisional settle (admission's store: Redis, or the hold's row) until metering records the request. An
engine that dies after serving, before its emitter hands the event to the broker, leaves that event only in its
spool, which a replaced pod (a new name, an emptyDir) never reads again. The worker bills such requests from the
gateway's copy once it is older than QUILT_UNREPORTED_USAGE_GRACE_SECONDS: the same ingest, idempotent by request id,
so an engine event that does arrive (first or later) is never counted twice."""

import json
import logging

from django.conf import settings

from gateway.admission import unreported_tenants, unreported_usage
from metering.services import usage_ingest

log = logging.getLogger(__name__)


def unreported_usage_bill(*, older_than_seconds: float | None = None) -> int:
    """Ingests, for each tenant with a kept copy (`unreported_tenants`: not every tenant, the sweep runs every 30 s),
    the served requests metering has not recorded within the grace period; returns how many rows that wrote (the rest
    were recorded meanwhile: their settles now let go of the copies)."""
    grace = settings.QUILT_UNREPORTED_USAGE_GRACE_SECONDS if older_than_seconds is None else older_than_seconds
    written = 0
    for tenant_id in unreported_tenants():
        events = [json.loads(event) for event in unreported_usage(tenant_id=tenant_id, older_than_seconds=grace)]
        if not events:
            continue
        result = usage_ingest(events=events)  # announces each: the final settle drops the gateway's copy
        written += result.inserted
        if result.inserted:
            log.warning("billed %d requests of tenant %s from the gateway's record: their engine never reported them",
                        result.inserted, tenant_id)  # fmt: skip
    return written
