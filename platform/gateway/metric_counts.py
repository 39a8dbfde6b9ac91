"""Counters and histograms kept as plain numbers per label values, handed to prometheus_client at scrape time.

prometheus_client's own `Counter.inc` and `Histogram.observe` take a lock per value and walk the buckets in Python
(about 540 bytecodes of a streamed request). Here an increment is an addition to an attribute and
an observation a `bisect` (C) and two additions; `collect` builds the same families, samples, names, labels and
values that prometheus_client's metrics give (`_total`, cumulative `_bucket`s with Go-formatted `le`, `_count`,
`_sum`, `_created`), and `tests/gateway/test_metric_counts.py` compares the two expositions for the same
observations. No lock: the gateway observes and scrapes on its process's one event loop thread."""

import math
import time
from bisect import bisect_left

import prometheus_client.metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString


def _created_series() -> bool:
    """prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, or `disable_created_metrics()`)."""
    return getattr(prometheus_client.metrics, "_use_created", True)


class CounterValue:
    __slots__ = ("value", "created")

    def __init__(self):
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramValue:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative: the first bound at or above the value
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1


class _Family:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames=(), registry=None):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.children: dict[tuple, object] = {}
        self._only = None if self.labelnames else self._child()
        if registry is not None:
            registry.register(self)

    def labels(self, *values):
        """The child for these label values, made on first use (prometheus_client's check: one value per name)."""
        child = self.children.get(values)
        if child is None:
            if not self.labelnames:
                raise ValueError(f"No label names were set when constructing {self.name}")
            if len(values) != len(self.labelnames):
                raise ValueError("Incorrect label count")
            key = tuple(str(value) for value in values)
            child = self.children.get(key) or self._child()
            self.children[key] = self.children[values] = child
        return child

    def _child(self):
        raise NotImplementedError

    def _one(self):
        if self._only is None:
            raise ValueError(f"No label values given for {self.name}: call labels() first")
        return self._only

    def _series(self):
        """(label values, child) once each, in order of first use; the unlabelled metric's one child."""
        if self._only is not None:
            return [((), self._only)]
        seen, series = set(), []
        for values, child in list(self.children.items()):
            if id(child) not in seen and all(type(value) is str for value in values):
                seen.add(id(child))
                series.append((values, child))
        return series

    def describe(self):
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self):
        metric = Metric(self.name, self.documentation, self.kind)
        created = _created_series()
        for values, child in self._series():
            labels = dict(zip(self.labelnames, values, strict=True))
            for suffix, extra, value in self._samples(child):
                metric.add_sample(self.name + suffix, {**labels, **extra}, value)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]


class Counter(_Family):
    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames=(), registry=None):
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _child(self):
        return CounterValue()

    def inc(self, amount: float = 1) -> None:
        self._one().inc(amount)

    def _samples(self, child):
        return [("_total", {}, child.value)]


class Histogram(_Family):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames=(), buckets=(), registry=None):
        bounds = [float(bound) for bound in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _child(self):
        return HistogramValue(self.bounds)

    def observe(self, amount: float) -> None:
        self._one().observe(amount)

    def _samples(self, child):
        samples, total = [], 0.0
        for bound, count in zip(self.bounds, child.counts, strict=True):
            total += count
            samples.append(("_bucket", {"le": floatToGoString(bound)}, total))
        samples.append(("_count", {}, total))
        if self.bounds[0] >= 0:
            samples.append(("_sum", {}, child.sum))
        return samples
