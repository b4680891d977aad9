"""Telemetry: JSON logs with request ids and redaction, per-service registries, tracing, the internal app."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import logging
import socket

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from deepinfer.config import CommonSettings
from deepinfer.telemetry import (
    JsonFormatter,
    PromptRedactionFilter,
    TelemetryError,
    counter,
    extract_trace_context,
    gauge,
    histogram,
    inject_trace_headers,
    internal_app,
    loggable_text,
    new_registry,
    render,
    request_context,
    serve_internal,
    setup_logging,
    setup_tracer_provider,
    setup_tracing,
)


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_carry_request_id_and_extras(root_logger):
    stream = io.StringIO()
    setup_logging(CommonSettings(log_level="debug"), stream=stream)
    log = logging.getLogger("deepinfer.test")
    with request_context("req-42"):
        log.info("routed %s", "ok", extra={"worker_id": "decode-1", "num_cached_tokens": 32})
    log.debug("outside")
    first, second = _lines(stream)
    assert first["msg"] == "routed ok" and first["level"] == "info" and first["logger"] == "deepinfer.test"
    assert first["request_id"] == "req-42"
    assert first["worker_id"] == "decode-1" and first["num_cached_tokens"] == 32
    assert first["ts"].endswith("+00:00")
    assert "request_id" not in second


async def test_request_id_follows_tasks(root_logger):
    stream = io.StringIO()
    setup_logging(CommonSettings(), stream=stream)

    async def work(request_id: str) -> None:
        with request_context(request_id):
            await asyncio.sleep(0)
            logging.getLogger("t").info("step")

    await asyncio.gather(work("a"), work("b"))
    assert sorted(line["request_id"] for line in _lines(stream)) == ["a", "b"]


def test_exceptions_are_logged(root_logger):
    stream = io.StringIO()
    setup_logging(CommonSettings(), stream=stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("t").exception("failed")
    (line,) = _lines(stream)
    assert "RuntimeError: boom" in line["exc"]


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompt_text_only_with_log_prompts(root_logger, log_prompts: bool):
    stream = io.StringIO()
    setup_logging(CommonSettings(log_prompts=log_prompts), stream=stream)
    secret = "my private prompt about project X"
    logging.getLogger("t").info("request", extra={"prompt": secret, "completion": "the answer", "num_tokens": 7})
    (line,) = _lines(stream)
    assert (secret in stream.getvalue()) is log_prompts
    assert ("the answer" in stream.getvalue()) is log_prompts
    assert line["num_tokens"] == 7
    if not log_prompts:
        assert line["prompt"] == f"<redacted {len(secret)} chars>"
    assert (loggable_text(secret, log_prompts) == secret) is log_prompts


def test_setup_logging_is_idempotent_and_sets_level(root_logger):
    setup_logging(CommonSettings(log_level="warning"), stream=io.StringIO())
    stream = io.StringIO()
    setup_logging(CommonSettings(log_level="warning", log_format="text"), stream=stream)
    assert sum(getattr(h, "_deepinfer", False) for h in root_logger.handlers) == 1
    with request_context("r-1"):
        logging.getLogger("t").info("hidden")
        logging.getLogger("t").warning("shown", extra={"worker_id": "w"})
    (line,) = stream.getvalue().splitlines()
    assert "WARNING t [r-1] shown worker_id=w" in line


def test_redaction_filter_alone():
    record = logging.LogRecord("t", logging.INFO, "", 0, "m", None, None)
    record.messages = [{"role": "user", "content": "hello"}]
    assert PromptRedactionFilter(log_prompts=False).filter(record)
    assert "hello" not in JsonFormatter().format(record)


def test_registries_are_per_service():
    a, b = new_registry(), new_registry(process_metrics=False)
    requests = counter(a, "requests", "Requests.", ["status"])
    counter(b, "requests", "Requests.", ["status"])  # same name, another registry: no clash
    gauge(a, "num_running", "Running.").set(3)
    histogram(a, "ttft_seconds", "TTFT.").observe(0.02)
    requests.labels(status="ok").inc(2)
    body, content_type = render(a)
    text = body.decode()
    assert 'deepinfer_requests_total{status="ok"} 2.0' in text
    assert "deepinfer_num_running 3.0" in text
    assert 'deepinfer_ttft_seconds_bucket{le="0.025"} 1.0' in text
    assert content_type.startswith("text/plain")
    assert "deepinfer_requests_total{" not in render(b)[0].decode()


def test_tracing_propagates_traceparent():
    with setup_tracing(CommonSettings(), "gateway").start_as_current_span("route"):
        assert "traceparent" not in inject_trace_headers({"x": "1"})  # exporter none: no span, no trace
    tracer = TracerProvider().get_tracer("gateway")
    with tracer.start_as_current_span("route") as span:
        headers = inject_trace_headers({"x": "1"})
    assert headers["x"] == "1" and headers["traceparent"].startswith("00-")
    remote = trace.get_current_span(extract_trace_context(headers)).get_span_context()
    assert remote.trace_id == span.get_span_context().trace_id
    assert remote.span_id == span.get_span_context().span_id
    assert not trace.get_current_span(extract_trace_context(None)).get_span_context().is_valid


def test_console_exporter_exports(capsys):
    provider = setup_tracer_provider(CommonSettings(otel_exporter="console"), "scheduler")
    with provider.get_tracer("t").start_as_current_span("decide"):
        pass
    provider.shutdown()
    out = capsys.readouterr().out
    assert '"name": "decide"' in out and "deepinfer-scheduler" in out


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter") is not None, reason="otlp exporter installed")
def test_otlp_without_package_is_a_clear_error():
    with pytest.raises(TelemetryError, match="opentelemetry-exporter-otlp"):
        setup_tracing(CommonSettings(otel_exporter="otlp"), "decode")


def _app(ready: dict):
    registry = new_registry(process_metrics=False)
    counter(registry, "probes", "Probes.").inc()
    return internal_app(registry, lambda: ready["ok"], "gateway", not_ready_reason=lambda: ready["why"])


async def test_internal_app_endpoints():
    ready = {"ok": False, "why": "no decode worker known"}
    transport = httpx.ASGITransport(app=_app(ready))
    async with httpx.AsyncClient(transport=transport, base_url="http://internal") as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.get("/ready")
        assert response.status_code == 503 and response.json()["reason"] == "no decode worker known"
        ready["ok"] = True
        assert (await client.get("/ready")).status_code == 200
        metrics = await client.get("/metrics")
        assert "deepinfer_probes_total 1.0" in metrics.text


async def test_failing_readiness_check_is_503_not_500():
    def broken() -> bool:
        raise ConnectionError("nats down")

    app = internal_app(new_registry(process_metrics=False), broken, "scheduler")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://i") as client:
        response = await client.get("/ready")
    assert response.status_code == 503 and "nats down" in response.json()["reason"]


async def test_serve_internal_on_a_free_port():
    server = await serve_internal(_app({"ok": True, "why": ""}), "127.0.0.1", 0)
    try:
        assert server.port > 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            assert (await client.get("/health")).json()["service"] == "gateway"
            assert (await client.get("/ready")).status_code == 200
        with pytest.raises(OSError):  # the port is taken: the caller hears it, nothing exits
            await serve_internal(_app({"ok": True, "why": ""}), "127.0.0.1", server.port)
    finally:
        await server.stop()
    assert server.task.done()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
        pass
