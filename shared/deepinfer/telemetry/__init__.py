"""Logs, metrics, traces and the internal /health /ready /metrics app (docs/architecture.md §9)."""

from deepinfer.telemetry.health import InternalServer, internal_app, serve_internal
from deepinfer.telemetry.logging import (
    SENSITIVE_FIELDS,
    JsonFormatter,
    PromptRedactionFilter,
    TextFormatter,
    current_request_id,
    loggable_text,
    request_context,
    setup_logging,
)
from deepinfer.telemetry.metrics import (
    HIT_AGE_BUCKETS_S,
    LATENCY_BUCKETS_S,
    counter,
    gauge,
    histogram,
    new_registry,
    render,
)
from deepinfer.telemetry.tracing import (
    TelemetryError,
    extract_trace_context,
    inject_trace_headers,
    setup_tracer_provider,
    setup_tracing,
)

__all__ = [
    "HIT_AGE_BUCKETS_S",
    "LATENCY_BUCKETS_S",
    "SENSITIVE_FIELDS",
    "InternalServer",
    "JsonFormatter",
    "PromptRedactionFilter",
    "TelemetryError",
    "TextFormatter",
    "counter",
    "current_request_id",
    "extract_trace_context",
    "gauge",
    "histogram",
    "inject_trace_headers",
    "internal_app",
    "loggable_text",
    "new_registry",
    "render",
    "request_context",
    "serve_internal",
    "setup_logging",
    "setup_tracer_provider",
    "setup_tracing",
]
