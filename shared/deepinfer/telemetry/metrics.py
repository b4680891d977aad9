"""Prometheus metrics on a registry owned by each service object (never the global one)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.process_collector import ProcessCollector

#: Every metric name starts with this.
NAMESPACE = "deepinfer"

#: Latency buckets in seconds, 1 ms .. 60 s (TTFT, inter-token latency, request/reply round trips).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Seconds since a hit block's previous use: 1 s .. a week (the default TTL is 72 h).
HIT_AGE_BUCKETS_S = (
    1.0,
    10.0,
    60.0,
    600.0,
    3600.0,
    6 * 3600.0,
    24 * 3600.0,
    48 * 3600.0,
    72 * 3600.0,
    168 * 3600.0,
)

#: Token-count buckets (prompt lengths, cached tokens), 16 .. 128k.
TOKEN_BUCKETS = tuple(float(16 * 2**i) for i in range(14))


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry for one service, optionally with process CPU/memory/fd metrics."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(namespace=NAMESPACE, registry=registry)
    return registry


def counter(
    registry: CollectorRegistry, name: str, documentation: str, labelnames: Sequence[str] = ()
) -> Counter:
    """A counter `deepinfer_<name>_total` on `registry`."""
    return Counter(name, documentation, labelnames, namespace=NAMESPACE, registry=registry)


def gauge(registry: CollectorRegistry, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
    """A gauge `deepinfer_<name>` on `registry`."""
    return Gauge(name, documentation, labelnames, namespace=NAMESPACE, registry=registry)


def histogram(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    labelnames: Sequence[str] = (),
    buckets: Sequence[float] = LATENCY_BUCKETS_S,
) -> Histogram:
    """A histogram `deepinfer_<name>` on `registry` (latency buckets in seconds unless given)."""
    return Histogram(name, documentation, labelnames, namespace=NAMESPACE, registry=registry, buckets=buckets)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The Prometheus text exposition of `registry` and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
