"""The load generator of bench/serve/serve.py: streaming chat clients spread over several processes, each reporting
its own CPU use, so the generator is never the bottleneck it measures.

    results = run_load(base_url, model, prompts, concurrency=256, max_tokens=256, num_procs=16)

Each process runs `concurrency / num_procs` async clients that drain its share of the prompts. The `httpx`
client parses SSE lines with `json.loads` (light); `openai` uses the official SDK (what users run, heavier).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import resource
import time
from dataclasses import dataclass, field
from typing import Any

#: A client process above this share of one core is close to being the bottleneck: the bench warns.
CPU_WARN_FRACTION = 0.8


@dataclass
class RequestStats:
    """Client-side timings of one streamed request."""

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)


@dataclass
class ProcessResult:
    """One client process: its requests, wall window (Unix seconds) and CPU seconds."""

    requests: list[RequestStats]
    started_unix_s: float
    ended_unix_s: float
    cpu_s: float

    @property
    def cpu_fraction(self) -> float:
        """CPU seconds over wall seconds: 1.0 = one full core."""
        return self.cpu_s / max(1e-9, self.ended_unix_s - self.started_unix_s)


@dataclass
class LoadResult:
    """Every process's results, pooled."""

    processes: list[ProcessResult]

    @property
    def requests(self) -> list[RequestStats]:
        """All requests of all processes."""
        return [r for p in self.processes for r in p.requests]

    @property
    def wall_s(self) -> float:
        """First request sent to last request done, over all processes."""
        return max(p.ended_unix_s for p in self.processes) - min(p.started_unix_s for p in self.processes)

    @property
    def max_cpu_fraction(self) -> float:
        """The busiest client process's share of a core."""
        return max(p.cpu_fraction for p in self.processes)


def run_load(
    base_url: str | list[str], model: str, prompts: list[Any], concurrency: int, max_tokens: int, num_procs: int,
    client: str = "httpx", warm: bool = True, temperature: float = 0.0,
) -> LoadResult:
    """Split prompts and clients over `num_procs` processes (spawned, started together) and collect them;
    with several base URLs (gateways), process i talks to URL i modulo their number. `warm`: each client makes one
    request before the start (see `_clients`; False only to measure what that removes: bench/serve/client_warmup.py).
    Every request streams exactly max_tokens tokens (ignore_eos) at `temperature`."""
    urls = [base_url] if isinstance(base_url, str) else base_url
    num_procs = max(1, min(num_procs, concurrency))
    shares = [prompts[i::num_procs] for i in range(num_procs)]
    clients = [concurrency // num_procs + (1 if i < concurrency % num_procs else 0) for i in range(num_procs)]
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 2.0  # every process imports first, then all begin together
    params = {"max_tokens": max_tokens, "temperature": temperature}
    jobs = [(urls[i % len(urls)], model, share, n, params, client, start_at, warm)
            for i, (share, n) in enumerate(zip(shares, clients, strict=True))]
    with context.Pool(num_procs) as pool:
        return LoadResult(pool.starmap(_process_main, jobs))


def _process_main(
    base_url: str, model: str, prompts: list[Any], concurrency: int, params: dict[str, Any], client: str,
    start_at: float, warm: bool,
) -> ProcessResult:
    import httpx  # noqa: F401  (imported before the start line, not inside the timed window)

    return asyncio.run(_clients(base_url, model, prompts, concurrency, params, client, start_at, warm))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _clients(base_url: str, model: str, prompts: list[Any], concurrency: int, params: dict[str, Any],
                   client: str, start_at: float, warm: bool) -> ProcessResult:
    """The process's clients, built and warmed before the common start, then its window from the start to its last
    answer. Both are one-time costs of a fresh client process that no served request pays: an SDK or httpx client
    takes tens of ms to make (its SSL context), and its first request ~25-35 ms more on the 2-core dev CPU (httpx's
    and httpcore's lazy set-up: bench/serve/client_warmup.py), likely the one slow request in 16 of every c=1 point on
    the H200 (TTFT p99 67-104 ms against a p50 of 9-24 ms)."""
    queue: asyncio.Queue = asyncio.Queue()
    for messages in prompts:
        queue.put_nowait(messages)
    results: list[RequestStats] = []
    if client == "openai":
        import openai

        sdk = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
        one = _openai_request(sdk, model, params)
        if warm:
            await _warm(sdk.models.list())
    else:
        import httpx

        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        http = httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits)
        one = _httpx_request(http, model, params)
        if warm:
            await _warm(http.get("/models"))

    async def worker() -> None:
        while not queue.empty():
            results.append(await one(queue.get_nowait()))

    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu_before, started = _cpu_s(), time.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    ended, cpu_s = time.time(), _cpu_s() - cpu_before
    await (sdk.close() if client == "openai" else http.aclose())
    return ProcessResult(results, started, ended, cpu_s)


async def _warm(request: Any) -> None:
    """One cheap request (GET /v1/models) through a new client before the measured window; its outcome is moot."""
    with contextlib.suppress(Exception):  # a failed warm-up still set the client up; the measured requests tell
        await request


def _body(model: str, messages: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat request of `params` (max_tokens, temperature)."""
    return {"model": model, "messages": messages, **params, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def _httpx_request(http, model: str, params: dict[str, Any]):
    async def one(messages: Any) -> RequestStats:
        stats = RequestStats()
        sent = last = time.perf_counter()
        async with http.stream("POST", "/chat/completions", json=_body(model, messages, params)) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stats.num_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("delta", {}).get("content"):
                    continue
                last = _tick(stats, sent, last)
        stats.e2e_s = time.perf_counter() - sent
        return stats

    return one


def _openai_request(sdk, model: str, params: dict[str, Any]):
    async def one(messages: Any) -> RequestStats:
        stats = RequestStats()
        sent = last = time.perf_counter()
        stream = await sdk.chat.completions.create(
            model=model, messages=messages, **params, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                stats.num_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                last = _tick(stats, sent, last)
        stats.e2e_s = time.perf_counter() - sent
        return stats

    return one


def _tick(stats: RequestStats, sent: float, last: float) -> float:
    """Record a content chunk's arrival (TTFT for the first, an inter-token gap after); the new `last`."""
    now = time.perf_counter()
    if stats.ttft_s == 0.0:
        stats.ttft_s = now - sent
    else:
        stats.gaps_s.append(now - last)
    return now
