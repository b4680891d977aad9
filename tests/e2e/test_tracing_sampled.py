"""Sampling and every per-token span, on a stack of its own: the standard OTEL_TRACES_SAMPLER=parentbased_traceidratio
(ratio 0.5) on every service decides once per request, at the gateway where its trace starts: a sampled request is
one whole trace over every service, one left out is recorded nowhere (the workers follow the traceparent's sampled
flag); with otel_token_spans=all every token batch and SSE write of a sampled request is a span."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from deepinfer.telemetry.trace_file import read_spans
from deepinfer.up import Stack
from tests.e2e.conftest import STACK_ENV

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]
#: Half are sampled: all 16 in or all 16 out has a chance of 2 in 65,536.
NUM_REQUESTS = 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "DEEPINFER_OTEL_TOKEN_SPANS": "all",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    with Stack(port=0, env_overrides=env, start_timeout_s=240) as running:
        yield running


def _whole(spans: list[dict]) -> bool:
    """Every trace written so far has each worker's span and all its token batches (the decode worker records a
    batch's span after publishing it: a stream can end, and its root be written, before its last batch's span)."""
    names = Counter((s["trace_id"], s["name"]) for s in spans)
    roots = [s["trace_id"] for s in spans if s["name"] == "gateway.request"]
    return all(names[trace_id, name] for trace_id in roots
               for name in ("scheduler.route", "prefill.request", "decode.admission")) and \
        all(names[trace_id, "decode.token_batch"] >= MAX_TOKENS - 1 for trace_id in roots)


def _settled_spans(stack: Stack, timeout_s: float = 60) -> list[dict]:
    """Every span written: each trace whole, and two reads a second apart (the exporters flush every 0.2 s) agree
    (a sampled request's root may still come; how many are sampled is not known beforehand)."""
    deadline, previous = time.monotonic() + timeout_s, None
    while True:
        spans = read_spans(stack.trace_dir)
        if spans and previous is not None and len(spans) == len(previous) and _whole(spans):
            return spans
        if time.monotonic() > deadline:
            pytest.fail(f"spans in {stack.trace_dir} still changing, or a trace not whole, after {timeout_s} s")
        previous = spans
        time.sleep(1.0)


def test_a_sampled_request_is_a_whole_trace_with_every_token_span_and_the_rest_is_recorded_nowhere(sampled):
    client = openai.OpenAI(base_url=sampled.base_url, api_key="e2e", max_retries=0, timeout=60)
    num_chunks: dict[str, int] = {}
    for i in range(NUM_REQUESTS):
        stream = client.chat.completions.create(model=sampled.model_name, messages=QUESTION, max_tokens=MAX_TOKENS,
                                                stream=True,  # every request MAX_TOKENS long, whatever is sampled
                                                extra_body={"cache_salt": f"sampled-{i}", "ignore_eos": True})
        chunks = list(stream)
        num_chunks[chunks[0].id] = len(chunks)
    spans = _settled_spans(sampled)
    roots = {s["attributes"]["request_id"]: s for s in spans if s["name"] == "gateway.request"}
    assert set(roots) <= set(num_chunks) and 0 < len(roots) < NUM_REQUESTS, len(roots)

    # Left out at the gateway, left out everywhere: each worker recorded the sampled requests only, and no span
    # hangs under a parent that was not recorded.
    for name in ("scheduler.route", "prefill.request", "decode.admission"):
        assert sum(s["name"] == name for s in spans) == len(roots), name
    span_ids = {s["span_id"] for s in spans}
    assert all(s["parent_id"] is None or s["parent_id"] in span_ids for s in spans)

    for request_id, root in roots.items():
        trace = [s for s in spans if s["trace_id"] == root["trace_id"]]
        assert {s["service"] for s in trace} == {"gateway", "scheduler", "prefill", "decode"}
        # otel_token_spans=all: every token batch (the prefill worker sent the first token, one a step after it)
        batches = [s for s in trace if s["name"] == "decode.token_batch"]
        assert len(batches) == sum(s["attributes"]["num_tokens"] for s in batches) == MAX_TOKENS - 1
        assert len({s["attributes"]["step"] for s in batches}) == len(batches)
        # and every SSE write: one per event, but the opening rides with the first delta
        writes = [s for s in trace if s["name"] == "gateway.sse_write"]
        assert len(writes) >= num_chunks[request_id] - 1 > 2
        assert all(s["parent_id"] == root["span_id"] for s in writes)
