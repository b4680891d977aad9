"""Helpers of the migration tests (test_migration.py, test_speculative_migration.py): a stack with 1 prefill and 2
decode workers, the decode worker serving a request found by its admission counter, faults injected mid-stream."""

from __future__ import annotations

import time

import openai

from deepinfer.up import Stack
from tests.e2e.conftest import metrics, wait_until

DECODERS = ("decode-0", "decode-1")
#: Chunks read before the fault: well inside 64 tokens, after the prefill worker's first token.
KILL_AFTER_CHUNKS = 8


def admitted(pair: Stack) -> dict[str, float]:
    """Requests each decode worker admitted so far (a counter: it moves at admission, not at a heartbeat)."""
    return {name: sum(v for k, v in metrics(pair, name).items() if k.startswith("deepinfer_decode_requests_total"))
            for name in DECODERS}


def serving(pair: Stack, before: dict[str, float]) -> str:
    """The decode worker that admitted a request since `before`."""
    now = admitted(pair)
    busy = [name for name in DECODERS if now[name] > before[name]]
    assert len(busy) == 1, (before, now)
    return busy[0]


def reissues(pair: Stack) -> float:
    return metrics(pair, "gateway-0").get('deepinfer_gateway_reissues_total{kind="migration"}', 0.0)


def both_decoders_up(pair: Stack) -> None:
    """Wait for the killed worker's restart (the supervisor's) so the next test again has two."""
    pair.wait_ready(180)
    wait_until(lambda: all(metrics(pair, n)["deepinfer_worker_total_blocks"] > 0 for n in DECODERS), 60,
               "both decode workers up")
    time.sleep(2.5)  # a heartbeat of each reaches the scheduler and the gateway (lease 2 s)


def stream(client: openai.OpenAI, request: dict, fault=None) -> tuple[str, list[str], list]:
    text, finishes, usages = "", [], []
    chunks = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    for received, chunk in enumerate(chunks, start=1):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
        if fault is not None and received == KILL_AFTER_CHUNKS:
            fault()
    return text, finishes, usages


def assert_resumed(pair: Stack, streamed: tuple[str, list[str], list], text: str, max_tokens: int,
                   reissues_before: float, started_s: float) -> None:
    """A stream whose worker failed mid-way ended as the fault-free one: `text`, by length, usage counted once, moved
    once (a migration, not a retry from scratch), within a minute."""
    got_text, finishes, usages = streamed
    assert got_text == text
    assert finishes == ["length"]
    assert len(usages) == 1 and usages[0].completion_tokens == max_tokens
    assert reissues(pair) == reissues_before + 1  # it really moved
    assert time.monotonic() - started_s < 60
