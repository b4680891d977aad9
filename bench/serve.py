"""Serving path vs offline engine: N concurrent streaming clients against the stack, the same prompts offline.

    python bench/serve.py [--concurrency 4] [--num-requests 16] [--max-tokens 64] [--base-url URL]

Without --base-url it starts the whole stack (`deepinfer up`'s Stack: nats, scheduler, prefill, decode,
gateway) on the default model. Client-side metrics as ANCHORS.md defines them: TTFT (request sent → first
streamed token), ITL (every gap between streamed chunks, pooled), TPOT per request ((e2e − TTFT) / (tokens − 1)).
Then the offline engine (`deepinfer.LLM`) runs the same prompts in one batch after the stack is stopped, so the
two do not share the CPU. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

TOPICS = ["the sea", "volcanoes", "a lighthouse", "bread baking", "the moon", "trains", "bees", "chess"]


@dataclass
class RequestStats:
    """Client-side timings of one streamed request."""

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)


def conversations(num: int) -> list[list[dict]]:
    """Deterministic prompts of varied length."""
    return [[{"role": "user", "content": f"Tell me {i % 3 + 2} things about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(num)]


async def one_request(client, model: str, messages, max_tokens: int) -> RequestStats:
    """Stream one chat completion, timing the first token and every gap."""
    stats = RequestStats()
    sent = last = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            stats.num_tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        if stats.ttft_s == 0.0:
            stats.ttft_s = now - sent
        else:
            stats.gaps_s.append(now - last)
        last = now
    stats.e2e_s = time.perf_counter() - sent
    return stats


async def run_clients(base_url: str, model: str, prompts, concurrency: int, max_tokens: int):
    """`concurrency` clients drain a shared queue of prompts; returns per-request stats and wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    queue: asyncio.Queue = asyncio.Queue()
    for messages in prompts:
        queue.put_nowait(messages)
    results: list[RequestStats] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await one_request(client, model, queue.get_nowait(), max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] if ordered else float("nan")


def run_offline(model: str, prompts, max_tokens: int, max_num_seqs: int, threads: int) -> tuple[float, int]:
    """Seconds and output tokens of the offline engine on the same prompts, at most `max_num_seqs` at a time
    (the clients' concurrency) on `threads` torch threads (what the decode worker gets), so the comparison is
    like for like."""
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, progress=False, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    """Run the service side, then the offline side; print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--base-url", default=None, help="an already running stack (else one is started)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--offline-threads", type=int, default=1,
                        help="torch threads offline (default 1: what each worker gets on a 2-core machine)")
    args = parser.parse_args()
    prompts = conversations(args.num_requests)
    stack = None
    if args.base_url is None:
        from deepinfer.up import Stack

        stack = Stack(model=args.model, port=0, env_overrides={"DEEPINFER_GATEWAY_API_KEYS": ""})
        stack.start()
        stack.wait_ready()
    base_url = args.base_url or stack.base_url
    model = stack.model_name if stack else args.model
    try:
        asyncio.run(run_clients(base_url, model, prompts[:2], 2, 4))  # warm-up
        results, wall_s = asyncio.run(run_clients(base_url, model, prompts, args.concurrency, args.max_tokens))
    finally:
        if stack is not None:
            stack.stop()
    offline_s, offline_tokens = (float("nan"), 0) if args.no_offline else run_offline(
        stack.model if stack else args.model, prompts, args.max_tokens, args.concurrency, args.offline_threads)
    report(args, results, wall_s, offline_s, offline_tokens)


def report(args, results: list[RequestStats], wall_s: float, offline_s: float, offline_tokens: int) -> None:
    """The table and the JSON line."""
    ttft = [r.ttft_s * 1000 for r in results]
    itl = [g * 1000 for r in results for g in r.gaps_s]
    tpot = [(r.e2e_s - r.ttft_s) * 1000 / (r.num_tokens - 1) for r in results if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in results)
    service_tok_s = tokens / wall_s
    offline_tok_s = offline_tokens / offline_s if offline_tokens else float("nan")
    print(f"{len(results)} requests, concurrency {args.concurrency}, {args.max_tokens} output tokens each")
    print(f"{'metric':<26}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, values in (("TTFT ms", ttft), ("ITL ms", itl), ("TPOT ms", tpot)):
        print(f"{name:<26}{percentile(values, 50):>10.1f}{percentile(values, 90):>10.1f}{percentile(values, 99):>10.1f}")
    print(f"{'service output tok/s':<26}{service_tok_s:>10.1f}")
    print(f"{'offline output tok/s':<26}{offline_tok_s:>10.1f}")
    overhead = 1 - service_tok_s / offline_tok_s if offline_tokens else float("nan")
    print(f"{'service path overhead':<26}{overhead * 100:>9.1f}%  (1 - service/offline throughput)")
    print(json.dumps({
        "bench": "serve", "requests": len(results), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "itl_ms_p50": round(percentile(itl, 50), 1), "itl_ms_p99": round(percentile(itl, 99), 1),
        "tpot_ms_mean": round(statistics.fmean(tpot), 1) if tpot else None,
        "service_output_tok_s": round(service_tok_s, 1), "offline_output_tok_s": round(offline_tok_s, 1),
        "overhead": round(overhead, 3) if offline_tokens else None,
    }))


if __name__ == "__main__":
    main()
