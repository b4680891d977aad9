"""The KV data plane over real sockets on 127.0.0.1: auth, many-block gets, checksums, limits, leases, close."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator, Sequence

import pytest

from deepinfer.dataplane import (
    BlockNotFound,
    ChecksumError,
    DataPlaneAuthError,
    DataPlaneClient,
    DataPlaneConnectionError,
    DataPlaneServer,
    DataPlaneTimeout,
    FrameError,
    FrameHeader,
    FrameOp,
    LeaseExpired,
    ServerTimeouts,
    generate_secret,
)
from deepinfer.dataplane.auth import MAGIC, NONCE_BYTES, PROOF_BYTES, client_handshake, secret_key
from deepinfer.dataplane.frames import read_header
from deepinfer.testing.dataplane import InMemoryBlockProvider

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _blocks(num_blocks: int, size: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(num_blocks)]


@pytest.fixture
def secret() -> str:
    return generate_secret()


@contextlib.asynccontextmanager
async def serving(provider, secret, **kwargs) -> AsyncIterator[DataPlaneServer]:
    server = DataPlaneServer(provider, secret=secret, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close(drain_timeout_s=5)


async def test_get_many_blocks_in_one_round_trip(secret):
    provider = InMemoryBlockProvider()
    payloads = _blocks(64, MiB, seed=1)
    block_ids = list(range(100, 164))
    provider.add_lease("req-1", block_ids, payloads)
    async with (
        serving(provider, secret) as server,
        DataPlaneClient(server.address, secret, timeout_s=10) as client,
    ):
        assert server.address.startswith("127.0.0.1:")
        got = await client.get_blocks("req-1", block_ids)
        assert got == payloads
        assert server.metrics.requests == 1 and server.metrics.blocks_sent == 64
        assert server.metrics.bytes_sent == 64 * MiB == client.metrics.bytes_received

        best_s = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            await client.get_blocks("req-1", block_ids)
            best_s = min(best_s, time.perf_counter() - start)
        print(
            f"\ndata plane loopback: 64 x 1 MiB in {best_s * 1e3:.1f} ms = {64 * MiB / best_s / 1e6:.0f} MB/s"
        )
        assert server.metrics.connections == 1  # one connection reused for every request


async def test_put_has_and_get_by_hash(secret):
    provider = InMemoryBlockProvider()
    hashes = [bytes([i]) * 16 for i in range(1, 6)]
    payloads = _blocks(5, 4096, seed=2)
    async with serving(provider, secret) as server, DataPlaneClient(server.address, secret) as client:
        await client.put_blocks("layout-a", hashes[:3], payloads[:3])
        assert await client.has_blocks("layout-a", hashes) == [True, True, True, False, False]
        assert await client.has_blocks("layout-b", hashes[:1]) == [False]
        assert await client.get_blocks("", block_hashes=hashes[:3], layout_id="layout-a") == payloads[:3]
        with pytest.raises(BlockNotFound, match=hashes[4].hex()):
            await client.get_blocks("", block_hashes=hashes[4:], layout_id="layout-a")
        assert server.metrics.blocks_received == 3


async def test_a_wrong_secret_is_refused(secret):
    provider = InMemoryBlockProvider()
    provider.add_lease("req-1", [1], [b"kv" * 8])
    async with serving(provider, secret) as server:
        async with DataPlaneClient(server.address, generate_secret()) as intruder:
            with pytest.raises(DataPlaneAuthError, match="refused"):
                await intruder.get_blocks("req-1", [1])
        assert server.metrics.auth_failures == 1 and provider.num_reads == 0


async def test_client_refuses_a_server_that_cannot_prove_the_secret(secret):
    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(MAGIC + bytes(NONCE_BYTES))
        await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        writer.write(b"\x01" + bytes(PROOF_BYTES))  # "accepted", with a proof it cannot compute
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with DataPlaneClient(f"127.0.0.1:{port}", secret, timeout_s=5) as client:
            with pytest.raises(DataPlaneAuthError, match="server failed to prove"):
                await client.has_blocks("l", [b"\x01" * 16])
    finally:
        server.close()


async def test_unknown_lease_is_lease_expired_and_the_connection_stays_usable(secret):
    provider = InMemoryBlockProvider()
    provider.add_lease("req-1", [3], [b"x" * 64])
    async with serving(provider, secret) as server, DataPlaneClient(server.address, secret) as client:
        with pytest.raises(LeaseExpired, match="req-gone"):
            await client.get_blocks("req-gone", [3])
        assert await client.get_blocks("req-1", [3]) == [b"x" * 64]
        provider.end_lease("req-1")
        with pytest.raises(LeaseExpired):
            await client.get_blocks("req-1", [3])
        assert server.metrics.connections == 1 and server.metrics.errors == 2


class CorruptingProxy:
    """A TCP relay that flips one bit inside block `block_index` of the first frame with a payload, one way.

    Only the first such frame of the proxy's life is corrupted, whatever the connection.
    """

    def __init__(self, target_port: int, to_client: bool, block_index: int) -> None:
        self.target_port = target_port
        self.to_client = to_client
        self.block_index = block_index
        self.server: asyncio.Server | None = None
        self.corrupted = False

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        # Handshake bytes pass untouched: the server's greeting and verdict, the client's answer.
        down = self._pipe(s_reader, c_writer, [len(MAGIC) + NONCE_BYTES, 1 + PROOF_BYTES], self.to_client)
        up = self._pipe(c_reader, s_writer, [NONCE_BYTES + PROOF_BYTES], not self.to_client)
        await asyncio.gather(down, up, return_exceptions=True)
        for w in (c_writer, s_writer):
            w.close()

    async def _pipe(self, reader, writer, handshake_sizes: Sequence[int], corrupt: bool) -> None:
        try:
            for size in handshake_sizes:
                writer.write(await reader.readexactly(size))
            while True:
                prefix = await reader.readexactly(4)
                raw = await reader.readexactly(struct.unpack(">I", prefix)[0])
                header = FrameHeader.from_bytes(raw)
                payload = bytearray(await reader.readexactly(header.payload_bytes))
                if corrupt and not self.corrupted and header.num_blocks > self.block_index:
                    payload[sum(header.sizes[: self.block_index]) + 5] ^= 0x40
                    self.corrupted = True
                writer.write(prefix + raw + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_a_payload_corrupted_in_flight_is_a_checksum_error(secret):
    provider = InMemoryBlockProvider()
    block_ids = [10, 11, 12, 13]
    payloads = _blocks(4, 8192, seed=3)
    provider.add_lease("req-1", block_ids, payloads)
    async with serving(provider, secret) as server:
        proxy = CorruptingProxy(server.port, to_client=True, block_index=2)
        address = await proxy.start()
        try:
            async with DataPlaneClient(address, secret) as client:
                with pytest.raises(ChecksumError, match=r"block id 12 \(#2 of 4\)"):
                    await client.get_blocks("req-1", block_ids)
                # The connection was dropped, not reused: the next pull reconnects and gets clean bytes.
                assert await client.get_blocks("req-1", block_ids) == payloads
        finally:
            proxy.close()
        assert server.metrics.connections == 2


async def test_a_put_corrupted_in_flight_is_refused_by_the_server(secret):
    provider = InMemoryBlockProvider()
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    async with serving(provider, secret) as server:
        proxy = CorruptingProxy(server.port, to_client=False, block_index=1)
        address = await proxy.start()
        try:
            async with DataPlaneClient(address, secret) as client:
                with pytest.raises(ChecksumError, match=f"hash {hashes[1].hex()}"):
                    await client.put_blocks("layout-a", hashes, _blocks(3, 1000, seed=4))
        finally:
            proxy.close()
        assert provider.blocks == {}


async def _authenticated_raw(address: str, secret: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await client_handshake(reader, writer, secret_key(secret))
    return reader, writer


@pytest.mark.parametrize("oversized", ["length-prefix", "payload-sizes"])
async def test_oversized_frames_are_refused_without_allocating(secret, oversized):
    async with serving(InMemoryBlockProvider(), secret) as server:
        reader, writer = await _authenticated_raw(server.address, secret)
        tracemalloc.start()
        try:
            if oversized == "length-prefix":
                writer.write(struct.pack(">I", 0xFFFF_FFF0))  # announces a 4 GiB header
            else:
                header = FrameHeader(
                    op=FrameOp.PUT, correlation_id=9, num_blocks=1, sizes=[1 << 40], checksums=[0]
                )
                packed = header.to_bytes()
                writer.write(struct.pack(">I", len(packed)) + packed)  # announces a 1 TiB payload
            await writer.drain()
            reply = await asyncio.wait_for(read_header(reader, server.limits), timeout=5)
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # then the server hangs up
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            writer.close()
        assert reply.op == FrameOp.ERROR and reply.error_code == "too_large"
        assert peak_bytes < 8 * MiB
        assert server.metrics.errors == 1


async def test_a_silent_peer_is_dropped_after_the_handshake_timeout(secret):
    async with serving(InMemoryBlockProvider(), secret, timeouts=ServerTimeouts(handshake_s=0.2)) as server:
        host, port = server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        greeting = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
        assert greeting.startswith(MAGIC)
        assert await asyncio.wait_for(reader.read(), timeout=3) == b""
        writer.close()


async def test_concurrent_clients(secret):
    provider = InMemoryBlockProvider()
    leases = {f"req-{n}": _blocks(8, 32 * 1024, seed=10 + n) for n in range(8)}
    for request_id, payloads in leases.items():
        provider.add_lease(request_id, range(1, 9), payloads)

    async with serving(provider, secret) as server:
        clients = [DataPlaneClient(server.address, secret) for _ in range(8)]

        async def pull(client: DataPlaneClient, request_id: str) -> None:
            for _ in range(3):
                assert await client.get_blocks(request_id, range(1, 9)) == leases[request_id]

        try:
            await asyncio.gather(*(pull(c, r) for c, r in zip(clients, leases, strict=True)))
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        assert server.metrics.connections == 8 and server.metrics.requests == 24


async def test_a_client_timeout_drops_the_connection(secret):
    provider = InMemoryBlockProvider(read_delay_s=0.6)
    provider.add_lease("req-1", [1], [b"y" * 128])
    async with (
        serving(provider, secret) as server,
        DataPlaneClient(server.address, secret, timeout_s=0.2) as client,
    ):
        with pytest.raises(DataPlaneTimeout):
            await client.get_blocks("req-1", [1])
        provider.read_delay_s = 0.0
        assert await client.get_blocks("req-1", [1]) == [b"y" * 128]  # a fresh connection, no stale reply
        assert server.metrics.connections == 2


async def test_close_finishes_in_flight_requests(secret):
    provider = InMemoryBlockProvider(read_delay_s=0.5)
    payloads = _blocks(4, 4096, seed=5)
    provider.add_lease("req-1", [1, 2, 3, 4], payloads)
    server = DataPlaneServer(provider, secret=secret)
    await server.start()
    busy = DataPlaneClient(server.address, secret)
    idle = DataPlaneClient(server.address, secret)
    assert await idle.has_blocks("l", [b"\x01" * 16]) == [False]  # connected, then idle
    pull = asyncio.create_task(busy.get_blocks("req-1", [1, 2, 3, 4]))
    while provider.num_reads == 0:
        await asyncio.sleep(0.01)

    await server.close()
    assert pull.done() and pull.result() == payloads
    with pytest.raises(DataPlaneConnectionError):
        await idle.has_blocks("l", [b"\x01" * 16])  # idle connection closed, listener gone
    await busy.close()
    await idle.close()


async def test_export_serve_pull_import_is_bitwise_equal(secret):
    torch = pytest.importorskip("torch")
    from deepinfer.engine.kv_transfer import check_layout, export_blocks, import_blocks, kv_layout_of
    from deepinfer.protocol import KvHandle

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shape = (2, 20, 16, 2, 32)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    src = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    dst = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    src_ids, dst_ids = [4, 9, 2, 17, 11], [1, 2, 3, 4, 5]

    class CacheProvider:  # a sync provider, as a worker's pool would be: runs on a worker thread
        def read_blocks(self, request_id, block_ids, block_hashes, layout_id):
            if request_id != "req-kv":
                raise LeaseExpired(request_id)
            return export_blocks(src, block_ids)

        def write_blocks(self, layout_id, block_hashes, payloads):
            raise NotImplementedError

        def has_blocks(self, layout_id, block_hashes):
            return [False] * len(block_hashes)

    layout = kv_layout_of(src, 16, "bfloat16")
    async with serving(CacheProvider(), secret) as server:
        handle = KvHandle(
            request_id="req-kv",
            block_hashes=[bytes([i]) * 16 for i in src_ids],
            block_ids=src_ids,
            num_tokens=80,
            owner_worker_id="prefill-0",
            data_plane_address=server.address,
            layout=layout,
            layout_id=layout.layout_id(),
            lease_expires_at_unix_s=time.time() + 30,
        )
        check_layout(handle, kv_layout_of(dst, 16, "bfloat16"))
        async with DataPlaneClient(handle.data_plane_address, secret) as client:
            payloads = await client.get_blocks(
                handle.request_id, handle.block_ids, layout_id=handle.layout_id
            )
    import_blocks(dst, dst_ids, payloads)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[:, src_ids].view(torch.int16), b[:, dst_ids].view(torch.int16))


async def test_get_into_buffers_receives_in_place_and_checks_every_block(secret):
    provider = InMemoryBlockProvider()
    block_ids = [10, 11, 12, 13]
    payloads = _blocks(4, 256 * 1024, seed=5)  # past the stream's staging: straight from the socket
    provider.add_lease("req-1", block_ids, payloads)
    rows = bytearray(4 * 256 * 1024)
    views = [memoryview(rows)[i * 256 * 1024 : (i + 1) * 256 * 1024] for i in range(4)]
    async with serving(provider, secret) as server:
        async with DataPlaneClient(server.address, secret, max_blocks_per_request=3) as client:
            got = await client.get_blocks("req-1", block_ids, into=views)  # two frames: 3 + 1 blocks
            assert [g.obj for g in got] == [rows] * 4 and bytes(rows) == b"".join(payloads)
            with pytest.raises(FrameError, match="buffer of 1000"):
                await client.get_blocks("req-1", block_ids[:1], into=[memoryview(bytearray(1000))])
            with pytest.raises(ValueError, match="1 buffers for 2 blocks"):
                await client.get_blocks("req-1", block_ids[:2], into=views[:1])
            assert await client.get_blocks("req-1", block_ids[1:2]) == payloads[1:2]  # reconnected, in sync
        proxy = CorruptingProxy(server.port, to_client=True, block_index=1)
        address = await proxy.start()
        try:
            async with DataPlaneClient(address, secret) as client:
                with pytest.raises(ChecksumError, match=r"block id 11 \(#1 of 4\)"):
                    await client.get_blocks("req-1", block_ids, into=views)
                await client.get_blocks("req-1", block_ids, into=views)
                assert bytes(rows) == b"".join(payloads)
        finally:
            proxy.close()
