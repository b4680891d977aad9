"""A closed-loop load generator for any OpenAI-compatible server: `concurrency` clients, each sending its next
prompt as soon as its last answer ended, every answer streamed from /v1/completions (with the usage chunk) and
timed chunk by chunk into a `RequestRecord`.

Prompts are made of common words drawn with a fixed seed, so two runs (or two servers) see the same text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence

import httpx

from deepinfer.bench.metrics import RequestRecord

#: Common English words, one string (split once): prompts of plain text any tokenizer handles.
_WORDS = ("the of and to in is it that for on with as was by at be this from have or are an not but they his her"
          " one all were we when there can which their said if do will each about how up out them then she many"
          " some so these would other into has more two like him see time could no make than first been its who now"
          " people my made over did down only way find use may water long little very after words called just where"
          " most know")
WORDS = tuple(_WORDS.split(" "))


def make_prompts(num_prompts: int, num_words: int, seed: int = 0) -> list[str]:
    """`num_prompts` texts of `num_words` common words each, the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(num_words)) for _ in range(num_prompts)]


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists (GET /v1/models)."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def send(client: httpx.AsyncClient, base_url: str, body: dict,
               clock: Callable[[], float] = time.monotonic) -> RequestRecord:
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
    if any(choice.get("text") for choice in chunk.get("choices") or ()):
        record.chunk_s.append(now_s)
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens") or 0
        record.prompt_tokens = usage.get("prompt_tokens") or 0
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def completion_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """The request: greedy, streamed with the usage chunk; `ignore_eos` (vLLM's extension) for fixed lengths."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    return body | ({"ignore_eos": True} if ignore_eos else {})


async def run_point(base_url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int,
                    ignore_eos: bool = False, timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Every prompt once through `concurrency` closed-loop clients; the records in prompt order and the wall time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)
    records: list[RequestRecord | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                records[index] = await send(client, base_url, completion_body(model, prompts[index], max_tokens,
                                                                              ignore_eos))

        started = time.monotonic()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall_s = time.monotonic() - started
    return [r for r in records if r is not None], wall_s
