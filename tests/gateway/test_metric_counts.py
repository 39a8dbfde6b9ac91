"""The gateway's plain counters and histograms expose what prometheus_client's own metrics would for the same
observations: names, types, help, labels, cumulative buckets, counts and sums (`_created` times aside)."""

import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway import metric_counts, metrics

CREATED = re.compile(rb"^(\S+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)
OBSERVED = (0.0, 0.001, 0.0010001, 0.0025, 0.7, 1, 119.9, 120, 121, 1e9)


def text(registry) -> bytes:
    return CREATED.sub(rb"\1 T", generate_latest(registry))


def twins():
    """Each gateway metric beside prometheus_client's own metric of the same definition."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    pairs = []
    for family in (metrics.requests, metrics.refusals, metrics.ttft, metrics.latency, metrics.tokens,
                   metrics.disaggregation, metrics.prefill_fallbacks, metrics.prefill_seconds, metrics.kv_transfers):  # fmt: skip
        if isinstance(family, metric_counts.Histogram):
            args = {"buckets": family.bounds}
            mine = metric_counts.Histogram(family.name, family.documentation, family.labelnames, registry=ours, **args)
            real = prometheus_client.Histogram(family.name, family.documentation, family.labelnames, registry=theirs,
                                               **args)  # fmt: skip
        else:
            mine = metric_counts.Counter(family.name, family.documentation, family.labelnames, registry=ours)
            real = prometheus_client.Counter(family.name, family.documentation, family.labelnames, registry=theirs)
        pairs.append((mine, real))
    return ours, theirs, pairs


def test_the_exposition_is_prometheus_clients_for_the_same_observations():
    ours, theirs, pairs = twins()
    assert text(ours) == text(theirs)  # nothing observed yet: the unlabelled histogram's zeros, the others' headers
    for mine, real in pairs:
        for n, value in enumerate(OBSERVED):
            labels = [f"v{n % 3}" if i else "é \"q\"\n" for i in range(len(real._labelnames))]
            target, twin = (mine.labels(*labels), real.labels(*labels)) if labels else (mine, real)
            if isinstance(mine, metric_counts.Histogram):
                target.observe(value)
                twin.observe(value)
            else:
                target.inc(value)
                twin.inc(value)
    assert b"_bucket{" in text(ours) and text(ours) == text(theirs)
    assert metric_counts._created_series() and b"_created" in text(ours)


def test_labels_are_checked_and_remembered_as_prometheus_client_does():
    counter = metric_counts.Counter("quilt_test_things_total", "Things", ["a", "b"])
    with pytest.raises(ValueError):
        counter.labels("x")
    with pytest.raises(ValueError):
        counter.inc()
    with pytest.raises(ValueError):
        counter.labels("x", "y").inc(-1)
    assert counter.labels("x", "y") is counter.labels("x", "y")
    assert counter.labels(1, "y") is counter.labels("1", "y")  # values are strings, as prometheus_client makes them
    with pytest.raises(ValueError):
        metric_counts.Histogram("quilt_test_seconds", "Seconds", buckets=(2, 1))
    with pytest.raises(ValueError):
        metric_counts.Histogram("quilt_test_seconds", "Seconds").labels("x")
