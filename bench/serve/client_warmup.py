"""What a fresh client process's first request costs the load generator itself (bench/serve/serve_clients.py), against a
stub server that answers at once, so every millisecond is the client's own.

    PYTHONPATH=shared:. python bench/serve/client_warmup.py [--requests 8] [--repeats 3] [--out FILE]

The stub (asyncio on a free port, in this process's thread) answers any request with one SSE content event and
[DONE]. `run_load` at concurrency 1 sends --requests requests in a fresh client process, without the warm-up
request (`warm=False`: how bench/serve/serve.py measured before) and with it, --repeats times interleaved. Prints the
TTFT of every request and one JSON line: the first request's TTFT against the median of the others.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
from pathlib import Path

from bench.results_io import emit_json_line
from bench.serve.serve_clients import run_load

_EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
             + b"%x\r\n" % len(_EVENT) + _EVENT + b"\r\n0\r\n\r\n")


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every request on the connection (head, then content-length bytes of body) gets the one-event stream."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(_RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def start_stub() -> int:
    """The stub server on a free loopback port, on a daemon thread's event loop; its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(_answer, sock=sock))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return server.sockets[0].getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{start_stub()}/v1"
    prompts = [[{"role": "user", "content": "x"}]] * args.requests
    runs: dict[str, list[list[float]]] = {"cold": [], "warmed": []}
    for _ in range(args.repeats):
        for label, warm in (("cold", False), ("warmed", True)):
            load = run_load(url, "stub", prompts, 1, 1, 1, warm=warm)
            ttft = [round(r.ttft_s * 1000, 2) for r in load.requests]
            runs[label].append(ttft)
            print(f"{label:>6}: TTFT ms per request, in order: {ttft}")
    result = {"bench": "client_warmup", "requests": args.requests, "repeats": args.repeats, "ttft_ms": runs}
    for label, series in runs.items():
        result[f"{label}_first_ms"] = statistics.median(s[0] for s in series)
        result[f"{label}_rest_ms"] = statistics.median(v for s in series for v in s[1:])
    print(f"first request / the rest (medians), ms: cold {result['cold_first_ms']} / {result['cold_rest_ms']}, "
          f"warmed {result['warmed_first_ms']} / {result['warmed_rest_ms']}")
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
