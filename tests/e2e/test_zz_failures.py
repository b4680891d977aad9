"""Failures on the shared stack (this module runs last: it kills services and waits for the supervisor)."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.e2e.conftest import metrics, wait_until

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ask(client, stack) -> str:
    reply = client.chat.completions.create(model=stack.model_name, messages=QUESTION, temperature=0, max_tokens=12)
    return reply.choices[0].message.content


def test_decode_killed_mid_stream_gives_a_clean_error_then_serving_resumes(client, stack):
    stream = client.chat.completions.create(
        model=stack.model_name, messages=QUESTION, temperature=0.7, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    with pytest.raises(openai.APIError) as failure:  # the SSE error event surfaces as an APIError
        for _ in stream:
            received += 1
            if received == 5:
                stack.kill("decode-0", signal.SIGKILL)
                killed_at = time.monotonic()
    # by the gateway's worker lease (3 s) or its stream_timeout_s (5 s of silence), whichever a busy machine lets
    # come first; not the 120 s first-token timeout or a hang
    assert time.monotonic() - killed_at < 15.0
    assert received >= 5
    assert failure.value.message
    # The supervisor restarts the worker (model load included); then the stack serves again.
    wait_until(lambda: stack.restart_count("decode-0") >= 1, 30, "decode-0 to be restarted")
    text = wait_until(lambda: _try(ask, client, stack), 120, "a completion after decode-0 came back", 1.0)
    assert "Paris" in text


def test_scheduler_killed_under_streaming_clients_fails_no_request(client, stack):
    def fallback_routes() -> float:
        samples = metrics(stack, "gateway-0")
        return sum(v for k, v in samples.items() if k.startswith("deepinfer_gateway_fallback_routes_total"))

    before = fallback_routes()
    outcomes: list[str] = []
    stop = threading.Event()

    def stream_forever() -> None:
        while not stop.is_set():
            try:
                stream = client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=4,
                                                        stream=True)
                for _ in stream:
                    pass
                outcomes.append("ok")
            except openai.APIError as exc:
                outcomes.append(repr(exc))

    clients = [threading.Thread(target=stream_forever) for _ in range(8)]
    for thread in clients:
        thread.start()
    time.sleep(1.0)
    stack.kill("scheduler-0", signal.SIGKILL)
    # every scheduler replica dead: the gateway routes from its own heartbeat table until one is back
    wait_until(lambda: stack.restart_count("scheduler-0") >= 1, 10, "scheduler-0 to be restarted")
    time.sleep(5.0)
    stop.set()
    for thread in clients:
        thread.join(timeout=60)
    assert outcomes and all(outcome == "ok" for outcome in outcomes), outcomes
    if stack.num_schedulers == 1:
        assert fallback_routes() > before
    text = wait_until(lambda: _try(ask, client, stack), 30, "a completion after the scheduler came back", 0.5)
    assert "Paris" in text


def _try(fn, *args):
    try:
        return fn(*args)
    except openai.APIError:
        return None
