"""deepinfer.bench.load's plans against a fake OpenAI endpoint in memory (httpx.MockTransport): what each sends,
what a record keeps from the stream, and that a conversation's next turn resends the answer it streamed."""

import asyncio
import json
import math
import time

import httpx

from deepinfer.bench.load import ClosedLoop, Conversations, OpenLoop, completion_body


def fake_server(sent: list[dict], answer: str = " ok then", cached_tokens: int = 0) -> httpx.AsyncClient:
    """A /v1/completions that streams `answer` in two chunks and a usage chunk, keeping every request's body."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        half = len(answer) // 2
        chunks = [
            {"choices": [{"text": answer[:half]}]},
            {"choices": [{"text": answer[half:]}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(body["prompt"].split()),
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": cached_tokens},
                },
            },
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def play(plan, client: httpx.AsyncClient, start_s: float | None = None):
    done = []

    async def go():
        async with client:
            return await plan.run(client, "http://fake", start_s or time.monotonic(), done.append)

    records = asyncio.run(go())
    assert len(done) == len(records)
    return records


def test_a_closed_loop_sends_every_body_once_and_reads_the_stream():
    sent: list[dict] = []
    bodies = tuple(completion_body("m", f"prompt {i}", 2, ignore_eos=True) for i in range(5))
    records = play(ClosedLoop(bodies, concurrency=2), fake_server(sent, cached_tokens=1))
    assert sorted(b["prompt"] for b in sent) == [f"prompt {i}" for i in range(5)]
    assert all(
        b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in sent
    )
    for record in records:
        assert record.error is None and record.text == " ok then" and len(record.chunk_s) == 2
        assert (record.output_tokens, record.prompt_tokens, record.cached_tokens) == (2, 2, 1)
        assert record.sent_s <= record.chunk_s[0] <= record.chunk_s[1] <= record.end_s
        assert math.isnan(record.scheduled_s)


def test_an_open_loop_sends_on_schedule_and_keeps_when_it_meant_to():
    sent: list[dict] = []
    bodies = tuple(completion_body("m", f"p{i}", 2, ignore_eos=False) for i in range(3))
    start_s = time.monotonic() + 0.05
    records = play(OpenLoop(bodies, (0.0, 0.1, 0.05)), fake_server(sent), start_s)
    assert [b["prompt"] for b in sent] == ["p0", "p2", "p1"]  # in offset order
    assert [round(r.scheduled_s - start_s, 3) for r in records] == [0.0, 0.05, 0.1]
    # never early: each send waits for its own scheduled time. How late it goes is the machine's load (a busy CI
    # host may hold the loop for a while), so the late bound is only a generous one: it catches a schedule off by
    # seconds (offsets mis-scaled), never scheduling latency
    assert all(0 <= r.sent_s - r.scheduled_s < 5.0 for r in records)


def test_each_turn_resends_the_history_with_the_answer_it_streamed():
    sent: list[dict] = []
    records = play(
        Conversations("m", (("hello there", "and then"),), max_tokens=2), fake_server(sent, " fine")
    )
    assert [r.turn for r in records] == [0, 1]
    assert sent[0]["prompt"] == "User: hello there\nAssistant:"
    assert sent[1]["prompt"] == "User: hello there\nAssistant: fine\nUser: and then\nAssistant:"


def test_an_error_status_is_recorded_and_ends_the_conversation():
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    records = play(Conversations("m", (("a", "b", "c"),), max_tokens=2), client)
    assert len(records) == 1 and records[0].error == "HTTP 503: overloaded"
