"""Load generators for any OpenAI-compatible server: every answer streamed from /v1/completions (with the usage
chunk) and timed chunk by chunk into a `RequestRecord`. A sweep point is one of three plans:

- `ClosedLoop`: `concurrency` clients, each sending its next prompt as soon as its last answer ended.
- `OpenLoop`: each prompt sent at its own offset from the start (Poisson arrivals, a trace's timestamps),
  whatever the server's pace; a record keeps when it was meant to go, so a late generator shows.
- `Conversations`: clients that each hold one conversation, every turn resending the history, the model's answer
  and a new user message (deepinfer.bench.prompts), so a server with a prefix cache serves the history from it.

A plan is plain data: `split(n)` deals it to n processes (deepinfer.bench.generator) and `run` plays one share
against a start time on the monotonic clock, which every process of a machine shares.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from deepinfer.bench.metrics import RequestRecord
from deepinfer.bench.prompts import first_turn, next_turn

#: Called with every finished record (progress).
OnDone = Callable[[RequestRecord], None]


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists (GET /v1/models)."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def send(
    client: httpx.AsyncClient, base_url: str, body: dict, clock: Callable[[], float] = time.monotonic
) -> RequestRecord:
    """One streamed completion, timed; an error status or a broken stream is recorded, never raised."""
    record = RequestRecord(sent_s=clock())
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        _take_chunk(record, json.loads(line[6:]), clock())
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_s = clock()
    if record.error is None and not record.output_tokens:
        record.output_tokens = len(record.chunk_s)  # a server without the usage chunk: one token per chunk
    return record


def _take_chunk(record: RequestRecord, chunk: dict, now_s: float) -> None:
    """An SSE chunk: output text stamps the record; the usage chunk gives the token counts."""
    text = "".join(choice.get("text") or "" for choice in chunk.get("choices") or ())
    if text:
        record.chunk_s.append(now_s)
        record.text += text
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens") or 0
        record.prompt_tokens = usage.get("prompt_tokens") or 0
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def completion_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """The request: greedy, streamed with the usage chunk; `ignore_eos` (vLLM's extension) for fixed lengths."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body | ({"ignore_eos": True} if ignore_eos else {})


def _deal(items: Sequence, n: int) -> list[list]:
    """Round-robin `items` into `n` hands (item i to hand i % n)."""
    return [list(items[i::n]) for i in range(n)]


async def _sleep_until(deadline_s: float) -> None:
    await asyncio.sleep(max(0.0, deadline_s - time.monotonic()))


@dataclass(frozen=True)
class ClosedLoop:
    """Every body once through `concurrency` clients, each sending its next as its last answer ends."""

    bodies: tuple[dict, ...]
    concurrency: int

    @property
    def num_requests(self) -> int:
        return len(self.bodies)

    def split(self, n: int) -> list[ClosedLoop]:
        """Bodies dealt round-robin, clients shared out (no share without a client or a body)."""
        clients = [self.concurrency // n + (1 if i < self.concurrency % n else 0) for i in range(n)]
        return [
            ClosedLoop(tuple(hand), c)
            for hand, c in zip(_deal(self.bodies, n), clients, strict=True)
            if hand and c
        ]

    async def run(
        self, client: httpx.AsyncClient, base_url: str, start_s: float, on_done: OnDone
    ) -> list[RequestRecord]:
        """The records, in body order."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(len(self.bodies)):
            queue.put_nowait(index)
        records: list[RequestRecord | None] = [None] * len(self.bodies)

        async def user() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                records[index] = await send(client, base_url, self.bodies[index])
                on_done(records[index])

        await _sleep_until(start_s)
        await asyncio.gather(*(user() for _ in range(self.concurrency)))
        return [r for r in records if r is not None]


@dataclass(frozen=True)
class OpenLoop:
    """Body i sent at `offsets_s[i]` after the start, whether or not earlier answers have ended."""

    bodies: tuple[dict, ...]
    offsets_s: tuple[float, ...]

    @property
    def num_requests(self) -> int:
        return len(self.bodies)

    def split(self, n: int) -> list[OpenLoop]:
        """Requests dealt round-robin, each keeping its offset."""
        return [
            OpenLoop(tuple(b), tuple(o))
            for b, o in zip(_deal(self.bodies, n), _deal(self.offsets_s, n), strict=True)
            if b
        ]

    async def run(
        self, client: httpx.AsyncClient, base_url: str, start_s: float, on_done: OnDone
    ) -> list[RequestRecord]:
        """The records, in send order; each one's `scheduled_s` is when it was meant to go."""

        async def one(body: dict, scheduled_s: float) -> RequestRecord:
            record = await send(client, base_url, body)
            record.scheduled_s = scheduled_s
            on_done(record)
            return record

        tasks = []
        for body, offset_s in sorted(zip(self.bodies, self.offsets_s, strict=True), key=lambda pair: pair[1]):
            await _sleep_until(start_s + offset_s)
            tasks.append(asyncio.create_task(one(body, start_s + offset_s)))
        return list(await asyncio.gather(*tasks))


@dataclass(frozen=True)
class Conversations:
    """One client per conversation, its turns in order: turn t+1 is sent when turn t's answer has ended."""

    model: str
    #: [conversation][turn]: the user's message.
    messages: tuple[tuple[str, ...], ...]
    max_tokens: int
    ignore_eos: bool = False

    def split(self, n: int) -> list[Conversations]:
        """Conversations dealt round-robin."""
        return [
            Conversations(self.model, tuple(hand), self.max_tokens, self.ignore_eos)
            for hand in _deal(self.messages, n)
            if hand
        ]

    async def run(
        self, client: httpx.AsyncClient, base_url: str, start_s: float, on_done: OnDone
    ) -> list[RequestRecord]:
        """The records, conversation by conversation, turn by turn; a failed turn ends its conversation."""

        async def converse(messages: Sequence[str]) -> list[RequestRecord]:
            records: list[RequestRecord] = []
            prompt = first_turn(messages[0])
            for turn, message in enumerate(messages):
                if turn:
                    prompt = next_turn(prompt, records[-1].text, message)
                record = await send(
                    client, base_url, completion_body(self.model, prompt, self.max_tokens, self.ignore_eos)
                )
                record.turn = turn
                records.append(record)
                on_done(record)
                if record.error:
                    break
            return records

        await _sleep_until(start_s)
        per_conversation = await asyncio.gather(*(converse(m) for m in self.messages))
        return [record for records in per_conversation for record in records]

    @property
    def num_requests(self) -> int:
        """Every turn of every conversation (a failure cuts its conversation short)."""
        return sum(len(m) for m in self.messages)


Plan = ClosedLoop | OpenLoop | Conversations
