"""The gateway's Prometheus metrics: requests by route and status, TTFT, end-to-end latency, tokens, in flight."""

from __future__ import annotations

import time

from opentelemetry.trace import INVALID_SPAN, Span
from prometheus_client import CollectorRegistry

from deepinfer.telemetry import counter, gauge, histogram
from deepinfer.telemetry.metrics import TOKEN_BUCKETS


class GatewayMetrics:
    """Metrics on the service's own registry (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = counter(registry, "gateway_requests", "HTTP requests by route and status", ["route", "status"])
        self.ttft_s = histogram(registry, "gateway_ttft_seconds", "Request received -> first token sent", ["route"])
        self.e2e_s = histogram(registry, "gateway_e2e_seconds", "Request received -> response done", ["route"])
        self.output_tokens = counter(registry, "gateway_output_tokens", "Tokens generated for clients")
        self.prompt_tokens = counter(registry, "gateway_prompt_tokens", "Prompt tokens of accepted requests")
        self.cached_tokens = counter(registry, "gateway_cached_tokens", "Prompt tokens served from the KV cache")
        self.prompt_len = histogram(
            registry, "gateway_prompt_length_tokens", "Prompt length per request", buckets=TOKEN_BUCKETS
        )
        self.in_flight = gauge(registry, "gateway_in_flight_requests", "Requests being served now")
        self.reissues = counter(
            registry, "gateway_reissues", "Requests re-issued to another worker: kind=start (a prefill or decode "
            "admission retried) or migration (resumed mid-stream)", ["kind"],
        )
        self.fallback_routes = counter(
            registry, "gateway_fallback_routes", "Requests the gateway routed itself because no scheduler answered "
            "(reason: no_scheduler, timeout, error)", ["reason"],
        )
        #: The in-flight count as a plain int (the drain waits for it to reach 0).
        self.num_in_flight = 0

    def begin(self, route: str, span: Span | None = None) -> RequestRecord:
        """Start timing one request (counts it in flight until `end`); `span` is its root span, ended there."""
        return RequestRecord(self, route, span)


class RequestRecord:
    """The metrics and root span of one request; `end` is idempotent, so every exit path may call it."""

    def __init__(self, metrics: GatewayMetrics, route: str, span: Span | None = None) -> None:
        self.metrics = metrics
        self.route = route
        self.span = span or INVALID_SPAN
        self.start_s = time.monotonic()
        self._first_token_seen = False
        self._ended = False
        metrics.in_flight.inc()
        metrics.num_in_flight += 1

    def prompt(self, num_prompt_tokens: int) -> None:
        """Count an accepted prompt."""
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.prompt_len.observe(num_prompt_tokens)

    def first_token(self) -> None:
        """Record TTFT (once)."""
        if not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.ttft_s.labels(self.route).observe(time.monotonic() - self.start_s)

    def end(self, status: int, num_output_tokens: int = 0, num_cached_tokens: int = 0) -> None:
        """Count the request with its final status and tokens (once)."""
        if self._ended:
            return
        self._ended = True
        self.metrics.in_flight.dec()
        self.metrics.num_in_flight -= 1
        self.metrics.requests.labels(self.route, str(status)).inc()
        self.metrics.e2e_s.labels(self.route).observe(time.monotonic() - self.start_s)
        self.metrics.output_tokens.inc(num_output_tokens)
        self.metrics.cached_tokens.inc(num_cached_tokens)
        if self.span.is_recording():
            self.span.set_attributes({"http.response.status_code": status, "num_output_tokens": num_output_tokens,
                                      "num_cached_tokens": num_cached_tokens})
        self.span.end()
