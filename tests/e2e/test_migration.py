"""Migration on a stack of its own (1 prefill + 2 decode workers, migration on as by default): the decode worker
serving a request is killed (SIGKILL) or frozen (SIGSTOP) mid-way; the official client still gets the whole answer,
equal to the fault-free one, for greedy and seeded sampling, streamed or not, with usage counted once."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from deepinfer.up import Stack
from deepinfer.up.child_spec import SupervisorError
from tests.e2e.conftest import STACK_ENV, metrics, wait_until
from tests.e2e.migration import (
    DECODERS,
    admitted,
    assert_resumed,
    both_decoders_up,
    reissues,
    serving,
    stream,
)

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]
MAX_TOKENS = 64
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


@pytest.fixture(scope="module")
def fault_free(pair: Stack, client: openai.OpenAI) -> dict[str, str]:
    texts = {}
    for sampling in SAMPLINGS:
        text, finishes, usages = stream(client, _request(pair, sampling))
        assert finishes == ["length"] and usages[0].completion_tokens == MAX_TOKENS
        texts[sampling] = text
    return texts


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_stream_survives_its_decode_worker(pair, client, fault_free, sampling, sig):
    before, victim, admitted_before = reissues(pair), [], admitted(pair)

    def fault() -> None:
        victim.append(serving(pair, admitted_before))
        pair.kill(victim[0], sig)

    started = time.monotonic()
    try:
        streamed = stream(client, _request(pair, sampling), fault)
    finally:
        if sig == signal.SIGSTOP and victim:
            # Resumed, unless the supervisor has already killed it to restart it (its liveness probe gives a frozen
            # worker 10 s, which a loaded machine can take to finish the stream elsewhere): then the restart is what
            # comes back, and both_decoders_up waits for it.
            with contextlib.suppress(SupervisorError):
                pair.kill(victim[0], signal.SIGCONT)
    assert victim, "the stream ended before the fault"
    assert_resumed(pair, streamed, fault_free[sampling], MAX_TOKENS, before, started)
    both_decoders_up(pair)


def test_a_non_streamed_request_survives_its_decode_worker(pair, client, fault_free):
    import threading

    before, victim, admitted_before = reissues(pair), [], admitted(pair)

    def kill_when_running() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not victim:
            try:
                victim.append(serving(pair, admitted_before))
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
    assert reissues(pair) == before + 1
    both_decoders_up(pair)


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
