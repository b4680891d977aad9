"""The per-token SSE path writes the same bytes as building and dumping the pydantic models (the reference),
for every kind of text, finish reason and usage setting, in both API shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.gateway.openai_models import CompletionChoice, CompletionResponse, DeltaMessage
from services.gateway.output import ChoiceDelta
from services.gateway.presenters import CHAT, COMPLETIONS, _without_usage, sse

TEXTS = ["Hello", "", " world", 'quo"te \\ back', "line\nbreak\ttab", "é€😀", "</script>&<>", "\u2028\x00\x1f"]


def generation(include_usage: bool) -> SimpleNamespace:
    return SimpleNamespace(response_id="chatcmpl-1f\u00e9", created=1_700_000_000, model_name='m"odel',
                           include_usage=include_usage, logprobs=False, num_top_logprobs=0, echo=False,
                           outputs=[SimpleNamespace(index=0), SimpleNamespace(index=1)], rules=None)


def reference(presenter, formatter, delta: ChoiceDelta) -> str:
    """What the pydantic models give for this delta."""
    if presenter is CHAT:
        return formatter._chunk(delta.index, DeltaMessage(content=delta.text), logprobs=None,
                                finish_reason=delta.finish_reason)
    choice = CompletionChoice(index=delta.index, text=delta.text, logprobs=None, finish_reason=delta.finish_reason)
    chunk = CompletionResponse(**formatter._base(), choices=[choice])
    return sse(_without_usage(chunk, formatter.generation.include_usage))


@pytest.mark.parametrize("presenter", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_fast_events_equal_the_pydantic_ones(presenter, include_usage: bool):
    formatter = presenter.stream(generation(include_usage))
    for index in (0, 1):
        for text in TEXTS:
            for finish in (None, "stop", "length"):
                delta = ChoiceDelta(index, text, finish_reason=finish)
                events = formatter.delta(delta)
                if not text and finish is None:
                    assert events == []
                    continue
                (event,) = events
                assert event == reference(presenter, formatter, delta)
                assert json.loads(event[len("data: "):])["choices"][0]["index"] == index


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_streamed_response_runs_on_the_requests_task_with_no_disconnect_listener(spec_version: str):
    import asyncio

    from services.gateway.app import SseResponse

    caller = asyncio.current_task()
    tasks, sent, closed = [], [], []

    async def body():
        try:
            for text in ("a", "b"):
                tasks.append(asyncio.current_task())
                yield text
        finally:
            closed.append(True)

    async def receive():
        raise AssertionError("nothing waits on receive: the stream polls for the disconnect itself")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
    await SseResponse(body(), media_type="text/event-stream")(scope, receive, send)
    assert tasks == [caller, caller] and closed == [True]
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b", b""]


async def test_a_failed_send_ends_the_stream_and_closes_its_generator():
    from starlette.requests import ClientDisconnect

    from services.gateway.app import SseResponse

    closed = []

    async def body():
        try:
            while True:
                yield "x"
        finally:
            closed.append(True)

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    async def receive():
        raise AssertionError("not called")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    with pytest.raises(ClientDisconnect):
        await SseResponse(body(), media_type="text/event-stream")(scope, receive, send)
    assert closed == [True]


def usage_generation(include_usage: bool) -> SimpleNamespace:
    """`generation` with token counts: two choices over a 7-token prompt, some of it cached by tier."""
    from services.gateway.generation import Generation
    from services.gateway.recipe import Prompt

    g = generation(include_usage)
    g.runs = [SimpleNamespace(request=SimpleNamespace(prompt_token_ids=list(range(7))))] * 2
    g.prompts, g.n = [Prompt(list(range(7)))], 2
    g.outputs = [SimpleNamespace(index=0, num_output_tokens=3, num_cached_tokens=4,
                                 cached_tokens_by_tier={"device": 4}),
                 SimpleNamespace(index=1, num_output_tokens=5, num_cached_tokens=None, cached_tokens_by_tier=None)]
    g.usage = lambda: Generation.usage(g)
    g.usage_dict = lambda: Generation.usage_dict(g)
    return g


@pytest.mark.parametrize("presenter", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_opening_frame_and_closing_equal_the_pydantic_ones(presenter, include_usage: bool):
    g = usage_generation(include_usage)
    formatter = presenter.stream(g)
    empty = formatter.chunk_type(**formatter._base(), choices=[]).model_dump(mode="json")
    assert formatter._empty_chunk() == empty
    assert formatter.head.startswith("data: " + json.dumps({k: v for k, v in empty.items() if k != "usage"},
                                                           ensure_ascii=False, separators=(",", ":"))[:-3])
    if presenter is CHAT:
        assert formatter.opening() == [formatter._chunk(i, DeltaMessage(role="assistant", content=""))
                                       for i in (0, 1)]
    closing = formatter.closing()
    if include_usage:
        usage = formatter.chunk_type(**formatter._base(), choices=[], usage=g.usage()).model_dump(mode="json")
        assert closing == [sse(usage), "data: [DONE]\n\n"]
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 4, "cached_tokens_by_tier": {"device": 4}}
        assert usage["usage"]["total_tokens"] == 15
    else:
        assert closing == ["data: [DONE]\n\n"]
