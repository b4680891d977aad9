"""Which per-token events of a traced request become spans (`otel_token_spans`), and the standard sampler
settings (OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG) as every exporting service honours them."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from deepinfer.config import CommonSettings
from deepinfer.telemetry import new_registry, setup_tracer_provider
from deepinfer.telemetry.hops import Hops, TokenSpans
from deepinfer.telemetry.trace_file import read_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def picked(spans: TokenSpans, num_events: int) -> list[int]:
    """The indexes of the events (the last one flagged) that become spans."""
    return [i for i in range(num_events) if spans.wanted(i == num_events - 1)]


def test_first_last_picks_the_first_and_the_last_event_only():
    assert picked(TokenSpans(otel_context.Context()), 256) == [0, 255]
    assert picked(TokenSpans(otel_context.Context()), 2) == [0, 1]
    assert picked(TokenSpans(otel_context.Context()), 1) == [0]  # one batch: it is both


def test_all_picks_every_event():
    assert picked(TokenSpans(otel_context.Context(), every=True), 5) == [0, 1, 2, 3, 4]


def test_a_stream_cut_short_keeps_its_first_span_only():
    spans = TokenSpans(otel_context.Context())
    assert [spans.wanted(False) for _ in range(4)] == [True, False, False, False]


@pytest.mark.parametrize(("setting", "every"), [(None, False), ("first_last", False), ("all", True), ("ALL", True)])
def test_the_setting_reaches_the_hops_through_the_services_tracer(tmp_path: Path, setting, every):
    common = CommonSettings(otel_exporter="file", otel_file_dir=tmp_path,
                            **({} if setting is None else {"otel_token_spans": setting}))
    provider = setup_tracer_provider(common, "decode")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "decode")
    assert hops.every_token_span is every
    assert hops.token_spans(otel_context.Context()).every is every
    provider.shutdown()


def test_a_tracer_from_elsewhere_gets_first_last():
    assert not Hops(TracerProvider().get_tracer("t"), new_registry(False), "decode").every_token_span


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="otel_token_spans"):
        CommonSettings(otel_token_spans="some")


def test_observe_counts_every_event_without_a_span(tmp_path: Path):
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "decode")
    registry = new_registry(False)
    hops = Hops(provider.get_tracer("t"), registry, "decode")
    hops.observe("token_batch", 0.001, 3)
    hops.observe("token_batch", 0.002)
    provider.shutdown()
    assert registry.get_sample_value("deepinfer_decode_hop_seconds_count", {"hop": "token_batch"}) == 4
    assert registry.get_sample_value("deepinfer_decode_hop_seconds_sum", {"hop": "token_batch"}) == pytest.approx(0.005)
    assert read_spans(tmp_path) == []


def _under_remote_parent(hops: Hops, sampled: bool) -> bool:
    """Whether a hop under a caller's traceparent (sampled flag as given) records, as the bus delivers it."""
    headers = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-{'01' if sampled else '00'}"}
    token = otel_context.attach(propagate.extract(headers))
    try:
        with hops.span("admission") as span:
            return span.is_recording()
    finally:
        otel_context.detach(token)


def test_by_default_every_trace_is_sampled_and_a_callers_decision_is_followed(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "decode")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "decode")
    with hops.span("admission") as root:
        assert root.is_recording()
    assert _under_remote_parent(hops, sampled=True)
    assert not _under_remote_parent(hops, sampled=False)
    provider.shutdown()
    assert {(s["name"], s["parent_id"]) for s in read_spans(tmp_path)} == {
        ("decode.admission", None), ("decode.admission", "00f067aa0ba902b7")}


@pytest.mark.parametrize(("ratio", "root_recorded"), [("0", False), ("1", True)])
def test_parent_based_ratio_decides_at_the_root_and_follows_the_caller_below(tmp_path: Path, monkeypatch, ratio,
                                                                             root_recorded):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", ratio)
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "gateway")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "gateway")
    assert hops.recording  # the service can record: whether a request is recorded is its trace's decision
    root = hops.tracer.start_span("gateway.request")
    assert root.is_recording() is root_recorded and root.get_span_context().trace_flags.sampled is root_recorded
    with hops.current(root), hops.span("route") as child:
        assert child.is_recording() is root_recorded  # the root's decision, whatever the ratio says of the child
    root.end()
    assert _under_remote_parent(hops, sampled=True)  # downstream: the caller decided
    assert not _under_remote_parent(hops, sampled=False)
    provider.shutdown()
    names = sorted(s["name"] for s in read_spans(tmp_path))
    assert names == (["gateway.admission", "gateway.request", "gateway.route"] if root_recorded
                     else ["gateway.admission"])
