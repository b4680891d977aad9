"""Failures on the shared stack (this module runs last: it kills services and waits for the supervisor)."""

from __future__ import annotations

import signal
import time

import openai
import pytest

from tests.e2e.conftest import wait_until

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


def test_scheduler_killed_requests_fail_fast_with_503_until_it_is_back(client, stack):
    stack.kill("scheduler-0", signal.SIGKILL)
    # NATS drops a dead client's queue subscription when it sees the socket close; a request sent in that
    # instant can still be routed to it, which is the route timeout (2 s) rather than a NoResponders.
    time.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failure:
        ask(client, stack)
    assert failure.value.status_code == 503
    # NoResponders at once, or (sent to the dead replica's subscription) both route attempts' 2 s timeouts: not the
    # request's own timeout
    assert time.monotonic() - started < 2 * 2.0 + 2.0
    assert failure.value.response.headers.get("retry-after")
    text = wait_until(lambda: _try(ask, client, stack), 30, "a completion after the scheduler came back", 0.5)
    assert "Paris" in text
    assert stack.restart_count("scheduler-0") >= 1


def _try(fn, *args):
    try:
        return fn(*args)
    except openai.APIError:
        return None
