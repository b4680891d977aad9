"""One trace per request across every process: gateway, scheduler, prefill and decode spans, parented hop by
hop through the traceparent that rides in NATS headers (the stack runs the file exporter)."""

from __future__ import annotations

import pytest

from deepinfer.telemetry.trace_file import read_spans
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

#: span name -> the name of its parent (None: the root).
PARENT_OF = {
    "gateway.request": None,
    "gateway.tokenize": "gateway.request",
    "gateway.route": "gateway.request",
    "scheduler.route": "gateway.route",
    "gateway.prefill": "gateway.request",
    "prefill.request": "gateway.prefill",
    "prefill.queue": "prefill.request",
    "prefill.compute": "prefill.request",
    "gateway.decode_admission": "gateway.request",
    "decode.admission": "gateway.decode_admission",
    "decode.kv_transfer": "decode.admission",
    "decode.token_batch": "decode.admission",
    "gateway.sse_write": "gateway.request",
}


def trace_of(stack, request_id: str) -> list[dict]:
    """Every span of the trace whose root is the gateway span of `request_id` (empty until it is written)."""
    spans = read_spans(stack.trace_dir)
    roots = [s for s in spans if s["name"] == "gateway.request" and s["attributes"].get("request_id") == request_id]
    if not roots:
        return []
    return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]


def test_a_streamed_request_is_one_trace_over_every_service_parented_hop_by_hop(client, stack):
    # A cache_salt no earlier request used: nothing is cached, so the router sends it through every hop (a prompt
    # the decode worker already holds would skip the separate prefill).
    # ignore_eos: all 8 tokens whatever is sampled, so the first and last batch are 6 steps apart.
    stream = client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=8, stream=True,
                                            extra_body={"cache_salt": "tracing-every-hop", "ignore_eos": True})
    request_id = next(iter(stream)).id
    for _ in stream:
        pass

    def complete() -> list[dict]:
        # every hop, and both token-batch and SSE-write spans: the decode worker records a batch's span after
        # publishing it, so the stream can end (and the root span be written) before the last batch's span is
        spans = trace_of(stack, request_id)
        names = [s["name"] for s in spans]
        every_hop = PARENT_OF.keys() <= set(names)
        return spans if every_hop and min(names.count("decode.token_batch"), names.count("gateway.sse_write")) >= 2 \
            else []

    spans = wait_until(complete, 15, f"every hop of {request_id} in {stack.trace_dir}")
    assert {s["service"] for s in spans} == {"gateway", "scheduler", "prefill", "decode"}
    by_id = {s["span_id"]: s for s in spans}
    for span in spans:
        expected = PARENT_OF.get(span["name"])
        parent = by_id.get(span["parent_id"]) if span["parent_id"] else None
        assert (parent["name"] if parent else None) == expected, span
    assert [s["attributes"]["via"] for s in spans if s["name"] == "decode.kv_transfer"] == ["data_plane"]
    # otel_token_spans=first_last (the default): of the 7 token batches (the prefill worker sent the first token)
    # and the SSE writes, the first and the last are spans, in the stream's order, nothing between
    batches = sorted((s for s in spans if s["name"] == "decode.token_batch"), key=lambda s: s["attributes"]["step"])
    assert len(batches) == 2 and batches[1]["attributes"]["step"] - batches[0]["attributes"]["step"] >= 6
    assert batches[0]["end_ns"] <= batches[1]["start_ns"]
    writes = sorted((s for s in spans if s["name"] == "gateway.sse_write"), key=lambda s: s["start_ns"])
    root = next(s for s in spans if s["name"] == "gateway.request")
    assert len(writes) == 2 and writes[0]["end_ns"] <= writes[1]["start_ns"] <= writes[1]["end_ns"] <= root["end_ns"]


def test_hop_histograms_count_what_the_traces_show(stack):
    from tests.e2e.conftest import metrics

    gateway, prefill, decode = (metrics(stack, name) for name in ("gateway-0", "prefill-0", "decode-0"))
    for samples, hops in ((gateway, ("tokenize", "route", "prefill", "decode_admission", "sse_write")),
                          (prefill, ("request", "queue", "compute")),
                          (decode, ("admission", "kv_transfer", "token_batch"))):
        service = "gateway" if samples is gateway else "prefill" if samples is prefill else "decode"
        for hop in hops:
            assert samples[f'deepinfer_{service}_hop_seconds_count{{hop="{hop}"}}'] >= 1, (service, hop)
