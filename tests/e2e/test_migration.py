"""Migration on a stack of its own (1 prefill + 2 decode workers, migration on as by default): the decode worker
serving a request is killed (SIGKILL) or frozen (SIGSTOP) mid-way; the official client still gets the whole answer,
equal to the fault-free one, for greedy and seeded sampling, streamed or not, with usage counted once."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import openai
import pytest

from deepinfer.up import Stack
from tests.e2e.conftest import STACK_ENV, metrics, wait_until

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]
DECODERS = ("decode-0", "decode-1")
MAX_TOKENS = 64
#: Chunks read before the fault: well inside the 64 tokens, after the prefill worker's first token.
KILL_AFTER_CHUNKS = 8
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "DEEPINFER_GATEWAY_MIGRATION": "true", "DEEPINFER_GATEWAY_WORKER_LEASE_S": "2"}
    with Stack(port=0, env_overrides=env, start_timeout_s=240, num_prefill=1, num_decode=2) as running:
        yield running


@pytest.fixture(scope="module")
def client(pair: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.base_url, api_key="e2e", max_retries=0, timeout=120)


def _request(pair: Stack, sampling: str) -> dict:
    return {"model": pair.model_name, "messages": QUESTION, "max_tokens": MAX_TOKENS,
            "extra_body": {"ignore_eos": True}, **SAMPLINGS[sampling]}


def _admitted(pair: Stack) -> dict[str, float]:
    """Requests each decode worker admitted so far (a counter: it moves at admission, not at a heartbeat)."""
    return {name: sum(v for k, v in metrics(pair, name).items() if k.startswith("deepinfer_decode_requests_total"))
            for name in DECODERS}


def _serving(pair: Stack, before: dict[str, float]) -> str:
    """The decode worker that admitted a request since `before`."""
    now = _admitted(pair)
    busy = [name for name in DECODERS if now[name] > before[name]]
    assert len(busy) == 1, (before, now)
    return busy[0]


def _reissues(pair: Stack) -> float:
    return metrics(pair, "gateway-0").get('deepinfer_gateway_reissues_total{kind="migration"}', 0.0)


def _both_decoders_up(pair: Stack) -> None:
    """Wait for the killed worker's restart (the supervisor's) so the next test again has two."""
    pair.wait_ready(180)
    wait_until(lambda: all(metrics(pair, n)["deepinfer_worker_total_blocks"] > 0 for n in DECODERS), 60,
               "both decode workers up")
    time.sleep(2.5)  # a heartbeat of each reaches the scheduler and the gateway (lease 2 s)


def _stream(client: openai.OpenAI, request: dict, fault=None) -> tuple[str, list[str], list]:
    text, finishes, usages = "", [], []
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    for received, chunk in enumerate(stream, start=1):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
        if fault is not None and received == KILL_AFTER_CHUNKS:
            fault()
    return text, finishes, usages


@pytest.fixture(scope="module")
def fault_free(pair: Stack, client: openai.OpenAI) -> dict[str, str]:
    texts = {}
    for sampling in SAMPLINGS:
        text, finishes, usages = _stream(client, _request(pair, sampling))
        assert finishes == ["length"] and usages[0].completion_tokens == MAX_TOKENS
        texts[sampling] = text
    return texts


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_stream_survives_its_decode_worker(pair, client, fault_free, sampling, sig):
    before, victim, admitted = _reissues(pair), [], _admitted(pair)

    def fault() -> None:
        victim.append(_serving(pair, admitted))
        pair.kill(victim[0], sig)

    started = time.monotonic()
    try:
        text, finishes, usages = _stream(client, _request(pair, sampling), fault)
    finally:
        if sig == signal.SIGSTOP and victim:
            pair.kill(victim[0], signal.SIGCONT)
    assert victim, "the stream ended before the fault"
    assert text == fault_free[sampling]
    assert finishes == ["length"]
    assert len(usages) == 1 and usages[0].completion_tokens == MAX_TOKENS
    assert _reissues(pair) == before + 1  # it really moved
    assert time.monotonic() - started < 60
    _both_decoders_up(pair)


def test_a_non_streamed_request_survives_its_decode_worker(pair, client, fault_free):
    import threading

    before, victim, admitted = _reissues(pair), [], _admitted(pair)

    def kill_when_running() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not victim:
            try:
                victim.append(_serving(pair, admitted))
            except AssertionError:  # not admitted yet
                time.sleep(0.02)
                continue
            time.sleep(0.3)  # mid-way: some tokens are out
            pair.kill(victim[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    reply = client.chat.completions.create(**_request(pair, "seeded"))
    killer.join()
    assert victim
    assert reply.choices[0].message.content == fault_free["seeded"]
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    assert _reissues(pair) == before + 1
    _both_decoders_up(pair)


def _decoders_idle(pair: Stack) -> bool:
    for name in DECODERS:
        sample = metrics(pair, name)
        if sample["deepinfer_worker_running_requests"] or (
            sample["deepinfer_worker_free_blocks"] != sample["deepinfer_worker_total_blocks"]
        ):
            return False
    return True


def test_shutdown_past_the_grace_ends_the_stream_and_the_workers_drop_it(pair):
    # A gateway of its own with a 1 s drain grace; SIGTERM while a long stream runs.
    base_url = pair.add_gateway("gateway-grace", {"DEEPINFER_GATEWAY_DRAIN_GRACE_S": "1"})
    pair.wait_ready(60)
    client = openai.OpenAI(base_url=base_url, api_key="e2e", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=pair.model_name, messages=QUESTION, max_tokens=2000,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError, match="shutting down"):  # the error event, then [DONE]
        for _ in stream:
            received += 1
            if received == 5:
                pair.kill("gateway-grace", signal.SIGTERM)
                stopped_at = time.monotonic()
    assert received > 5  # tokens kept flowing through the grace
    assert time.monotonic() - stopped_at < 1 + 10.0  # the 1 s grace, not the 2000 tokens (minutes)
    wait_until(lambda: _decoders_idle(pair), 30, "the decode workers to drop the request")
