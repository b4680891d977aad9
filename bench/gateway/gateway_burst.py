"""The gateway's cost of starting requests that arrive in a burst, and of streaming their tokens, on this CPU.

    PYTHONPATH=shared:. python bench/gateway/gateway_burst.py [--bursts 16 64] [--rounds 20] [--stream-tokens 256]
        [--gateway-root DIR] [--trace [--token-spans first_last|all]] [--out bench/results/NAME.json]

One real gateway process (`python -m services.gateway`, one process, the default model's tokenizer, the code
under `--gateway-root`, default this checkout) on a real nats-server on a free port, and the stand-in scheduler
and decode worker of bench/gateway/gateway_burst_workers.py in a process of their own (why stand-ins: see there). The
client (this process) keeps one HTTP/1.1 connection per concurrent request open and writes a burst of N
streamed chat requests (~30-token prompts, as bench/serve/serve.py) back to back, then reads every stream to its end;
each burst starts with the gateway idle.

Per burst size N, with max_tokens=1 (one token: the request is its start path plus one event):
  - the gateway process's CPU per request (user + system from /proc, all its threads);
  - the gateway's own hop histograms (tokenize, route, decode_admission, ...) from its /metrics, before and
    after: p50/p99 (interpolated in the bucket, as Prometheus does) and the mean (sum / count);
  - the client's TTFT (request written → first content event) p50/p99.
Then one burst of the largest N with `--stream-tokens` tokens each (the stand-in steps every `--step-ms`): the
gateway's CPU per streamed token, net of the start path measured above. With `--trace` the gateway runs the file
exporter (every request is a trace: the gateway starts them) into `--log-dir`/gateway-burst-traces, with
`otel_token_spans` as `--token-spans` says (unset: the code's default); the spans it wrote per request are counted
at the end. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.results_io import emit_json_line
from bench.serve.serve_hops import cpu_seconds, histogram_breakdown, scrape
from deepinfer.config import CommonSettings
from deepinfer.model_store import resolve_model
from deepinfer.nats_server import NatsServer, free_port
from deepinfer.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

MODEL = "bench"
TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "rivers", "deserts", "glaciers", "owls"]
HOPS = ("tokenize", "route", "decode_admission")
#: An SSE event carrying text (not the opening's empty content).
CONTENT = re.compile(rb'"content":"[^"]')


def prompt(i: int) -> list[dict[str, str]]:
    """bench/serve/serve.py's chat prompts (~30 tokens with the template)."""
    return [{"role": "user", "content": f"Tell me {i % 3 + 2} things about {TOPICS[i % len(TOPICS)]}, part {i}."}]


def request_bytes(port: int, i: int, max_tokens: int) -> bytes:
    """One streamed chat completion as HTTP/1.1 bytes (keep-alive)."""
    body = json.dumps({"model": MODEL, "messages": prompt(i), "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def read_stream(reader: asyncio.StreamReader, sent_s: float) -> float:
    """Read one chunked SSE response to its end; the time (s after `sent_s`) of the first content event."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"gateway answered {head[:200]!r}")
    first_s = None
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if first_s is None and CONTENT.search(data):
            first_s = time.perf_counter() - sent_s
        if size == 0:
            if first_s is None:
                raise RuntimeError("the stream ended without content")
            return first_s


class Client:
    """N keep-alive connections to the gateway; `burst` writes one request on each, then reads them all."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self) -> None:
        """Open the connections."""
        self.conns = [await asyncio.open_connection("127.0.0.1", self.port) for _ in range(self.n)]

    async def burst(self, max_tokens: int, first: int) -> list[float]:
        """One burst; each request's TTFT (s)."""
        payloads = [request_bytes(self.port, first + i, max_tokens) for i in range(self.n)]
        sent_s = time.perf_counter()
        for (_, writer), payload in zip(self.conns, payloads, strict=True):
            writer.write(payload)
        return list(await asyncio.gather(*(read_stream(reader, sent_s) for reader, _ in self.conns)))

    async def close(self) -> None:
        """Close the connections."""
        for _, writer in self.conns:
            writer.close()


def metric_sums(port: int) -> dict[str, tuple[float, float]]:
    """hop -> (sum s, count) of the gateway's hop histogram."""
    found: dict[str, list[float]] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        for suffix, index in (("_sum", 0), ("_count", 1)):
            prefix = f"deepinfer_gateway_hop_seconds{suffix}{{hop=\""
            if line.startswith(prefix):
                hop = line[len(prefix):line.index('"', len(prefix))]
                found.setdefault(hop, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {hop: (v[0], v[1]) for hop, v in found.items()}


class Rig:
    """nats-server, the stand-in workers and one gateway process."""

    def __init__(self, gateway_root: Path, step_ms: float, log_dir: Path, extra_path: str = "",
                 trace_env: dict[str, str] | None = None) -> None:
        self.gateway_root, self.step_ms, self.log_dir = gateway_root, step_ms, log_dir
        self.extra_path = extra_path
        self.trace_env = trace_env or {}
        self.nats = NatsServer()
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        """Start everything; return once the gateway's /health is 200."""
        self.nats.start()
        model_dir = resolve_model(None, CommonSettings().model_cache_dir, False)
        token_ids = Tokenizer.from_dir(model_dir).encode(" the quick brown fox jumps over a lazy dog" * 4)
        extra = f":{self.extra_path}" if self.extra_path else ""
        env = {**os.environ, "PYTHONPATH": f"{self.gateway_root / 'shared'}:{self.gateway_root}{extra}"}
        workers = subprocess.Popen(
            [sys.executable, str(ROOT / "bench/gateway/gateway_burst_workers.py"), self.nats.url, self.nats.token, MODEL,
             str(self.step_ms), ",".join(map(str, token_ids))], stdout=subprocess.PIPE, env=env, text=True)
        self.procs.append(workers)
        assert workers.stdout is not None and workers.stdout.readline().strip() == "ready"
        self.port, self.internal_port = free_port(), free_port()
        gateway_env = {**env, "DEEPINFER_NATS_URL": self.nats.url, "DEEPINFER_NATS_TOKEN": self.nats.token,
                       "DEEPINFER_MODEL": str(model_dir), "DEEPINFER_SERVED_MODEL_NAME": MODEL,
                       "DEEPINFER_GATEWAY_PORT": str(self.port), "DEEPINFER_GATEWAY_INTERNAL_PORT":
                       str(self.internal_port), "DEEPINFER_GATEWAY_PROCESSES": "1", "DEEPINFER_GATEWAY_API_KEYS": "",
                       "DEEPINFER_LOG_LEVEL": "warning", **self.trace_env}
        log = (self.log_dir / "gateway-burst-gateway.log").open("w")
        self.gateway = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=gateway_env,
                                        cwd=self.gateway_root, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(self.gateway)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {log.name}")
            time.sleep(0.2)
        raise RuntimeError("the gateway did not become healthy")

    def cpu_s(self) -> float:
        """The gateway process's CPU seconds so far."""
        return cpu_seconds({"gateway": self.gateway.pid})["gateway"]

    def stop(self) -> None:
        """Stop the processes and nats-server."""
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.stop()


async def measure_bursts(rig: Rig, n: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    """`rounds` bursts of `n` requests (after one warm-up burst): CPU per request, hops, TTFT."""
    client = Client(rig.port, n)
    await client.open()
    await client.burst(max_tokens, 0)
    await asyncio.sleep(0.2)
    buckets, sums, cpu = scrape({"gateway": rig.internal_port}), metric_sums(rig.internal_port), rig.cpu_s()
    ttfts: list[float] = []
    for r in range(rounds):
        ttfts += await client.burst(max_tokens, (r + 1) * n)
        await asyncio.sleep(0.05)  # the gateway is idle when the next burst arrives
    cpu = rig.cpu_s() - cpu
    after_buckets, after_sums = scrape({"gateway": rig.internal_port}), metric_sums(rig.internal_port)
    await client.close()
    hops = {row["hop"].removeprefix("gateway."): row for row in histogram_breakdown(buckets, after_buckets)}
    for hop, row in hops.items():
        total_s, count = (after_sums[hop][i] - sums.get(hop, (0.0, 0.0))[i] for i in (0, 1))
        row["mean_ms"] = round(total_s / count * 1000, 3) if count else None
    ttfts.sort()
    num = n * rounds
    return {"n": n, "rounds": rounds, "max_tokens": max_tokens, "cpu_us_per_request": round(cpu / num * 1e6, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 2),
            "ttft_p99_ms": round(ttfts[min(num - 1, int(0.99 * num))] * 1000, 2), "hops": hops}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the rig, measure every burst size, then streaming; stop the rig."""
    trace_dir = args.log_dir / "gateway-burst-traces"
    trace_env = {}
    if args.trace:
        shutil.rmtree(trace_dir, ignore_errors=True)
        trace_env = {"DEEPINFER_OTEL_EXPORTER": "file", "DEEPINFER_OTEL_FILE_DIR": str(trace_dir)}
        if args.token_spans:
            trace_env["DEEPINFER_OTEL_TOKEN_SPANS"] = args.token_spans
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rig = Rig(args.gateway_root.resolve(), args.step_ms, args.log_dir, args.extra_path, trace_env)
    try:
        rig.start()  # inside: a failed start still stops what it started
        bursts = [await measure_bursts(rig, n, args.rounds, 1) for n in args.bursts]
        stream = None
        if args.stream_tokens:
            n = max(args.bursts)
            stream = await measure_bursts(rig, n, max(1, args.rounds // 10), args.stream_tokens)
            start_us = next(b["cpu_us_per_request"] for b in bursts if b["n"] == n)
            per_request = stream["cpu_us_per_request"]
            stream["cpu_us_per_token"] = round((per_request - start_us) / (args.stream_tokens - 1), 2)
    finally:
        rig.stop()
    traced = None
    if args.trace:
        num_requests = sum((b["rounds"] + 1) * b["n"] for b in [*bursts, *([stream] if stream else [])])
        num_spans = sum(1 for path in trace_dir.glob("*.jsonl") for _ in path.open("rb"))
        traced = {"token_spans": args.token_spans, "spans": num_spans,
                  "spans_per_request": round(num_spans / num_requests, 2)}
    return {"bench": "gateway_burst", "label": args.label, "gateway_root": str(args.gateway_root),
            "extra_path": args.extra_path,
            "step_ms": args.step_ms,
            "bursts": bursts, "stream": stream, "trace": traced}


def print_table(result: dict[str, Any]) -> None:
    """Per burst size: CPU per request, TTFT, then each hop's p50/p99/mean."""
    print(f"gateway burst bench ({result['gateway_root']})")
    print(f"{'N':>4}{'CPU us/req':>12}{'TTFT p50':>10}{'p99':>8}  "
          + "".join(f"{hop + ' p50/p99/mean ms':>36}" for hop in HOPS))
    for b in result["bursts"]:
        cells = []
        for hop in HOPS:
            row = b["hops"].get(hop)
            cells.append(f"{row['p50_ms']:.2f}/{row['p99_ms']:.2f}/{row['mean_ms']:.2f}" if row else "-")
        print(f"{b['n']:>4}{b['cpu_us_per_request']:>12.0f}{b['ttft_p50_ms']:>10.2f}{b['ttft_p99_ms']:>8.2f}  "
              + "".join(f"{c:>36}" for c in cells))
    if result.get("trace"):
        print(f"traced: {result['trace']['spans_per_request']} spans per request written")
    s = result["stream"]
    if s:
        print(f"streaming: {s['n']} streams x {s['max_tokens']} tokens, {s['cpu_us_per_request']:.0f} CPU us/request,"
              f" {s['cpu_us_per_token']:.2f} CPU us per streamed token (net of the start path)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stream-tokens", type=int, default=256, help="0: no streaming run")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in decode worker's step")
    parser.add_argument("--gateway-root", type=Path, default=ROOT, help="a checkout whose gateway code runs")
    parser.add_argument("--extra-path", default="", help="appended to the processes' PYTHONPATH (e.g. a dir with "
                        "httptools, which uvicorn then uses instead of h11)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--label", default="", help="a name for the run in the JSON line")
    parser.add_argument("--trace", action="store_true", help="the gateway runs the file exporter")
    parser.add_argument("--token-spans", choices=["first_last", "all"],
                        help="with --trace: otel_token_spans (unset: the code's default)")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print_table(result)
    emit_json_line(result, args.out, append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
