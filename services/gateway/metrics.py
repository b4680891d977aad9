"""The gateway's Prometheus metrics: requests by route and status, TTFT, inter-token latency, end-to-end latency,
tokens, in flight."""

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
        self.itl_s = histogram(
            registry, "gateway_itl_seconds", "Inter-token latency: a choice's time between deliveries of its text, "
            "divided among the tokens delivered (one observation per token after the choice's first)", ["route"],
        )
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
        #: Per choice index: (time, output tokens) of its last delivery of text.
        self._last_delivery: dict[int, tuple[float, int]] = {}
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

    def delivered(self, choice: int, num_output_tokens: int) -> None:
        """A choice's text went out with `num_output_tokens` generated so far: TTFT at the request's first delivery;
        after a choice's first, the gap since its previous delivery, shared by the tokens that came in it (several
        arrive together with speculative decoding, or when a token completes a character), in the ITL histogram."""
        now = time.monotonic()
        self.first_token()
        last = self._last_delivery.get(choice)
        self._last_delivery[choice] = (now, num_output_tokens)
        if last is None or num_output_tokens <= last[1]:
            return
        num_new = num_output_tokens - last[1]
        itl = self.metrics.itl_s.labels(self.route)
        for _ in range(num_new):
            itl.observe((now - last[0]) / num_new)

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
