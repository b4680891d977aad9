"""kvcache store put/get GB/s and latency on loopback, beside a raw socket copy of the same bytes in the same run.

    PYTHONPATH=shared:. python bench/kv/kvstore.py [--block-mib 2] [--blocks 64] [--reps 10] [--fsync none]

Every server runs in a process of its own (as the store would), the client in this one, over 127.0.0.1:

    raw socket          a blocking socket: put = sendall of the bytes, recv_into one buffer, a 1-byte ack;
                        get = a 9-byte request, the bytes back into one buffer. The floor for moving the bytes.
    data plane (dict)   DataPlaneServer + DataPlaneClient over a dict (InMemoryBlockProvider): the protocol's cost.
    kvstore             DataPlaneServer over a KvStore: RAM tier large enough for every put of the run,
                        write-through to its segment files (the page cache; fsync per --fsync).
    kvstore (RAM full)  (puts only) a KvStore whose RAM tier holds two requests' worth of blocks, full after the
                        setup and the warm-up: every measured put evicts as many blocks as it adds, as in a store
                        that has run for a while. The allocator reuses the evicted blocks' memory (with the malloc
                        variables below), where a RAM tier still growing (`kvstore`) faults in fresh pages.
    kvstore (disk)      a KvStore with ram_bytes=0: every get reads the segment files (from the page cache: the
                        bench does not drop the machine's caches) and checks the checksums.

The paths take turns, one request each, so a noisy neighbour hits them alike. Throughput: requests of --blocks
blocks (puts under new hashes each time), the median of --reps. Latency: one block per request, p50 / p99 of
--samples. Prints a table and one JSON line; saves the JSON under bench/results/.

Run it also with glibc told to keep freed buffers (a store process would be started so), which removes the page
faults of every fresh 2 MiB block on both ends:

    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=4294967296 PYTHONPATH=shared:. python bench/kv/kvstore.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SECRET = "kvstore-bench-secret-0123456789abcdef"
LAYOUT = "bench-layout"
_RAW_REQUEST = struct.Struct("<cQ")  # op (b"P" put / b"G" get), bytes
#: op -> the paths that run it; "get (disk)" is compared with the raw get.
OPS = {
    "put": ("raw socket", "data plane (dict)", "kvstore", "kvstore (RAM full)"),
    "get (ram)": ("raw socket", "data plane (dict)", "kvstore"),
    "get (disk)": ("raw socket", "kvstore (disk)"),
}


# -- servers (child processes) --------------------------------------------------------------------------------
def _raw_server(conn: Connection) -> None:
    """Accept one connection; answer puts (receive into a buffer, ack) and gets (send a buffer) until it closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray()
    while (request := _recv_exactly(sock, bytearray(_RAW_REQUEST.size))) is not None:
        op, size = _RAW_REQUEST.unpack(request)
        if len(buffer) < size:
            buffer = bytearray(os.urandom(size))
        if op == b"P":
            _recv_exactly(sock, memoryview(buffer)[:size])
            sock.sendall(b"\x01")
        else:
            sock.sendall(memoryview(buffer)[:size])


def _recv_exactly(sock: socket.socket, buffer: bytearray | memoryview) -> bytearray | memoryview | None:
    view, received = memoryview(buffer), 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            return None
        received += n
    return buffer


def _dataplane_server(conn: Connection, store_fields: dict | None) -> None:
    """Serve a KvStore (store_fields: its StoreSettings) or, when None, a dict, until told to stop."""
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings
    from deepinfer.testing.dataplane import InMemoryBlockProvider

    provider = InMemoryBlockProvider() if store_fields is None else KvStore(StoreSettings(**store_fields))

    async def serve() -> None:
        server = DataPlaneServer(provider, secret=SECRET)
        conn.send(await server.start())
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the stop message
        await server.close()

    asyncio.run(serve())
    if store_fields is not None:
        provider.close()


def _start(target: Callable[..., None], *args: object) -> tuple[multiprocessing.Process, Connection, object]:
    """A server in a fresh process; what it sends first (its port or address)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return process, parent, parent.recv()


# -- clients (this process) -----------------------------------------------------------------------------------
class RawPath:
    """The raw socket client: the same bytes, no framing, no checksums, one receive buffer."""

    def __init__(self, port: int, blocks: list[bytes]) -> None:
        self.blocks = blocks
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.receive = bytearray(sum(len(b) for b in blocks))

    async def put(self, num_blocks: int) -> None:
        """Send num_blocks blocks, wait for the ack."""
        parts = self.blocks[:num_blocks]
        self.sock.sendall(_RAW_REQUEST.pack(b"P", sum(len(p) for p in parts)))
        for part in parts:
            self.sock.sendall(part)
        _recv_exactly(self.sock, bytearray(1))

    async def get(self, num_blocks: int) -> None:
        """Receive num_blocks blocks' bytes."""
        size = num_blocks * len(self.blocks[0])
        self.sock.sendall(_RAW_REQUEST.pack(b"G", size))
        _recv_exactly(self.sock, memoryview(self.receive)[:size])

    async def close(self) -> None:
        """Close the socket (the server process then exits)."""
        self.sock.close()


class DataPlanePath:
    """A DataPlaneClient to one server; gets read back the blocks stored by `setup`."""

    def __init__(self, address: str, blocks: list[bytes]) -> None:
        from deepinfer.dataplane import DataPlaneClient

        self.blocks = blocks
        self.client = DataPlaneClient(address, SECRET, timeout_s=120, max_blocks_per_request=len(blocks))
        self._next_hash = 0
        self.stored = self._fresh_hashes(len(blocks))

    def _fresh_hashes(self, n: int) -> list[bytes]:
        self._next_hash += n
        return [i.to_bytes(16, "little") for i in range(self._next_hash - n, self._next_hash)]

    async def setup(self) -> None:
        """Store the blocks the gets read."""
        await self.client.put_blocks(LAYOUT, self.stored, self.blocks)

    async def put(self, num_blocks: int) -> None:
        """Store num_blocks blocks under new hashes."""
        await self.client.put_blocks(LAYOUT, self._fresh_hashes(num_blocks), self.blocks[:num_blocks])

    async def get(self, num_blocks: int) -> None:
        """Read num_blocks stored blocks back (checksums verified by the client)."""
        got = await self.client.get_blocks("", block_hashes=self.stored[:num_blocks], layout_id=LAYOUT)
        assert len(got) == num_blocks

    async def close(self) -> None:
        """Close the connection."""
        await self.client.close()


async def _measure(paths: dict, args: argparse.Namespace, total_bytes: int) -> dict:
    """For each op, the paths in turns: --reps bulk requests each, then --samples one-block requests each."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for op, names in OPS.items():
        calls = {name: getattr(paths[name], "put" if op == "put" else "get") for name in names}
        bulk: dict[str, list[float]] = {name: [] for name in names}
        single: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            await calls[name](args.blocks)  # warm-up
        for samples, num_blocks, count in ((bulk, args.blocks, args.reps), (single, 1, args.samples)):
            for _ in range(count):
                for name in names:
                    start = time.perf_counter()
                    await calls[name](num_blocks)
                    samples[name].append(time.perf_counter() - start)
        results[op] = {name: _summary(total_bytes, bulk[name], single[name]) for name in names}
        raw_gb_s = results[op]["raw socket"]["gb_s"]
        for numbers in results[op].values():
            numbers["of_raw"] = round(numbers["gb_s"] / raw_gb_s, 3)
    return results


def _summary(total_bytes: int, bulk_s: list[float], single_s: list[float]) -> dict[str, float]:
    ordered = sorted(single_s)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "gb_s": round(total_bytes / statistics.median(bulk_s) / 1e9, 3),
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(p99 * 1e3, 3),
    }


# -- the run --------------------------------------------------------------------------------------------------
async def _run_paths(args: argparse.Namespace, blocks: list[bytes], servers: dict) -> dict:
    paths = {"raw socket": RawPath(servers["raw socket"], blocks)}
    for name in ("data plane (dict)", "kvstore", "kvstore (RAM full)", "kvstore (disk)"):
        paths[name] = DataPlanePath(servers[name], blocks)
        await paths[name].setup()
    try:
        return await _measure(paths, args, len(blocks) * len(blocks[0]))
    finally:
        for path in paths.values():
            await path.close()


def run(args: argparse.Namespace) -> dict:
    """Every path, in one run; the result as one dict."""
    block_bytes = int(args.block_mib * (1 << 20))
    blocks = [os.urandom(block_bytes) for _ in range(args.blocks)]
    # RAM for every put of the run (setup, warm-up, reps, samples): gets never miss the RAM tier.
    ram_bytes = block_bytes * (args.blocks * (args.reps + 2) + args.samples + 8)
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as ram_dir,
        tempfile.TemporaryDirectory(dir=args.dir) as full_dir,
        tempfile.TemporaryDirectory(dir=args.dir) as disk_dir,
    ):
        store = {"disk_bytes": 2 * ram_bytes, "fsync": args.fsync}
        started = {
            "raw socket": _start(_raw_server),
            "data plane (dict)": _start(_dataplane_server, None),
            "kvstore": _start(_dataplane_server, {**store, "disk_dir": ram_dir, "ram_bytes": ram_bytes}),
            "kvstore (RAM full)": _start(
                _dataplane_server, {**store, "disk_dir": full_dir, "ram_bytes": 2 * len(blocks) * block_bytes}
            ),
            "kvstore (disk)": _start(_dataplane_server, {**store, "disk_dir": disk_dir, "ram_bytes": 0}),
        }
        try:
            results = asyncio.run(_run_paths(args, blocks, {n: s[2] for n, s in started.items()}))
        finally:
            for process, conn, _ in started.values():
                with contextlib.suppress(OSError):  # the raw server has exited already: its client closed
                    conn.send("stop")
                process.join(timeout=60)
    return {
        "bench": "kvstore",
        "command": "python bench/kv/kvstore.py " + " ".join(sys.argv[1:]),
        "device": "cpu",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "block_bytes": block_bytes,
        "blocks_per_request": args.blocks,
        "reps": args.reps,
        "samples": args.samples,
        "fsync": args.fsync,
        # glibc's malloc returns freed 2 MiB buffers to the OS unless told otherwise: every fresh block then
        # costs page faults (see docs/journal/kvstore-2026-12.md, "Where the time went").
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "results": results,
    }


def print_table(result: dict) -> None:
    """One row per (op, path)."""
    malloc = " ".join(f"{k}={v}" for k, v in result["malloc_env"].items()) or "glibc malloc defaults"
    print(
        f"{result['blocks_per_request']} blocks x {result['block_bytes'] / (1 << 20):g} MiB per request, "
        f"fsync={result['fsync']}, {result['cpus']} CPUs, {malloc}; latency: one block per request"
    )
    print(f"{'op':<12}{'path':<20}{'GB/s':>8}{'of raw':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for op, paths in result["results"].items():
        for path, n in paths.items():
            print(
                f"{op:<12}{path:<20}{n['gb_s']:>8.2f}{n['of_raw']:>8.0%}{n['p50_ms']:>9.2f}{n['p99_ms']:>9.2f}"
            )


def main() -> None:
    """Measure, print the table and the JSON line, save the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per request for the throughput runs")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=50, help="one-block requests for the latency")
    parser.add_argument("--fsync", choices=["none", "batch", "always"], default="none")
    parser.add_argument("--dir", default=None, help="where the stores' temporary directories go")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON file (default: bench/results/kvstore-cpu-*.json)"
    )
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    print(json.dumps(result))
    out = args.out or RESULTS_DIR / f"kvstore-cpu-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
