"""DataPlaneClient: pulls (and pushes) KV blocks from one peer's data plane over one reused connection.

Requests on one client are serialised: one frame in flight per connection, matched to its reply by
correlation id. KV pulls are bandwidth-bound (MiB per block), so pipelining would buy little, while one
request at a time keeps recovery trivial: any failure mid-frame (timeout, connection loss, checksum mismatch,
bad frame) closes the connection and the next call reconnects, so a half-read stream is never reused. An
error *reply* is a complete frame and leaves the connection usable. Use one client per peer; callers that
want parallel streams to one peer make several clients.

The connection is a BlockStream: a get's blocks are received straight into the caller's buffers (`into`, e.g.
the rows of a staging pool) or into one buffer each, and each block's checksum is taken as it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from deepinfer.dataplane.auth import client_handshake, secret_key
from deepinfer.dataplane.errors import (
    DataPlaneConnectionError,
    DataPlaneError,
    DataPlaneTimeout,
    FrameError,
    error_from_code,
)
from deepinfer.dataplane.frames import (
    BytesLike,
    FrameHeader,
    FrameLimits,
    FrameOp,
    LeaseVia,
    byte_view,
    check_checksums,
    checksum,
    frame_buffers,
    payload_fields,
    read_header,
    write_frame,
)
from deepinfer.dataplane.metrics import DataPlaneMetrics
from deepinfer.dataplane.stream import BlockStream


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" → (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"data-plane address must be 'host:port', got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class PeerConnection:
    """What a client of one peer's data plane knows before it connects: address, secret, limits, metrics."""

    def __init__(self, address: str, secret: str | bytes | None, timeout_s: float, limits: FrameLimits | None,
                 max_blocks_per_request: int) -> None:
        if timeout_s <= 0 or max_blocks_per_request <= 0:
            raise ValueError("timeout_s and max_blocks_per_request must be positive")
        self.address = address
        self.host, self.port = parse_address(address)
        self.timeout_s = timeout_s
        self.limits = limits or FrameLimits()
        self.max_blocks_per_request = min(max_blocks_per_request, self.limits.max_blocks)
        self.metrics = DataPlaneMetrics()
        self._key = secret_key(secret)
        self._next_correlation_id = 1


class DataPlaneClient(PeerConnection):
    """Client of one peer's data plane ("host:port"), authenticated with the shared `secret`.

    Lifecycle: create (no I/O) → `get_blocks` / `put_blocks` / `has_blocks` (connects on first use, reuses
    the connection, reconnects after a failure) → `close()`. Every call is bounded by `timeout_s`.
    """

    def __init__(
        self,
        address: str,
        secret: str | bytes | None,
        timeout_s: float = 10.0,
        *,
        limits: FrameLimits | None = None,
        max_blocks_per_request: int = 64,
    ) -> None:
        super().__init__(address, secret, timeout_s, limits, max_blocks_per_request)
        self._lock = asyncio.Lock()
        self._reader: BlockStream | None = None
        self._writer: BlockStream | None = None

    async def __aenter__(self) -> DataPlaneClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def get_blocks(
        self,
        request_id: str,
        block_ids: Sequence[int] = (),
        *,
        block_hashes: Sequence[bytes] = (),
        layout_id: str = "",
        into: Sequence[memoryview] | None = None,
    ) -> list[BytesLike]:
        """Pull blocks by owner-local id within the lease `request_id` and/or by hash, every checksum verified.

        `into`: one writable buffer per block, of its exact size, that the block is received into (and returned
        as); without it each block is a `bytes`. On any error the buffers hold unverified bytes: discard them.
        Raises LeaseExpired (lease unknown or ended), BlockNotFound, ChecksumError naming the block,
        DataPlaneTimeout, DataPlaneConnectionError, or DataPlaneError carrying the server's message.
        """
        block_ids, block_hashes = list(block_ids), [bytes(h) for h in block_hashes]
        if block_ids and block_hashes and len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block_ids but {len(block_hashes)} block_hashes")
        num_blocks = len(block_ids) or len(block_hashes)
        if into is not None and len(into) != num_blocks:
            raise ValueError(f"{len(into)} buffers for {num_blocks} blocks")
        blocks: list[BytesLike] = []
        for start in range(0, num_blocks, self.max_blocks_per_request):
            end = start + self.max_blocks_per_request
            request = FrameHeader(
                op=FrameOp.GET,
                correlation_id=self._new_correlation_id(),
                request_id=request_id,
                layout_id=layout_id,
                block_ids=block_ids[start:end],
                block_hashes=block_hashes[start:end],
            )
            labels = [f"id {i}" for i in block_ids[start:end]] or [
                f"hash {h.hex()}" for h in block_hashes[start:end]
            ]
            reply, chunk = await self._request(request, [], labels, None if into is None else into[start:end])
            if len(chunk) != len(labels):
                raise DataPlaneError(f"{self.address} sent {len(chunk)} blocks for {len(labels)} requested")
            blocks.extend(chunk)
        return blocks

    async def put_blocks(
        self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[BytesLike]
    ) -> None:
        """Store blocks on the peer by (layout_id, hash); the peer verifies every checksum (ChecksumError)."""
        if len(block_hashes) != len(payloads):
            raise ValueError(f"{len(block_hashes)} block_hashes but {len(payloads)} payloads")
        views = [byte_view(p) for p in payloads]
        for start in range(0, len(views), self.max_blocks_per_request):
            chunk = views[start : start + self.max_blocks_per_request]
            request = FrameHeader(
                op=FrameOp.PUT,
                correlation_id=self._new_correlation_id(),
                layout_id=layout_id,
                block_hashes=[bytes(h) for h in block_hashes[start : start + len(chunk)]],
                **payload_fields(chunk),
            )
            await self._request(request, chunk, None)

    async def has_blocks(self, layout_id: str, block_hashes: Sequence[bytes]) -> list[bool]:
        """One flag per hash: does the peer hold the block under this layout?"""
        present: list[bool] = []
        hashes = [bytes(h) for h in block_hashes]
        for start in range(0, len(hashes), self.limits.max_blocks):
            chunk = hashes[start : start + self.limits.max_blocks]
            request = FrameHeader(
                op=FrameOp.HAS,
                correlation_id=self._new_correlation_id(),
                layout_id=layout_id,
                block_hashes=chunk,
            )
            reply, _ = await self._request(request, [], None)
            if len(reply.present) != len(chunk):
                raise DataPlaneError(
                    f"{self.address} answered {len(reply.present)} flags for {len(chunk)} hashes"
                )
            present.extend(reply.present)
        return present

    async def lease_blocks(self, layout_id: str, block_hashes: Sequence[bytes], host_id: str,
                           via: LeaseVia = LeaseVia.SHARED_MEMORY, *, request_id: str = "",
                           block_ids: Sequence[int] = ()) -> FrameHeader:
        """Lease the blocks' slots in the peer's shared-memory region (a peer on this host: `host_id` is ours;
        `via=TRANSFER_ENGINE`: a peer anywhere that serves its region to transfer engines); the reply carries
        `lease_id`, `region_path`, one `slots` grant per hash and, via a transfer engine, `remote_region`.
        `block_ids` (with `request_id`, via a transfer engine): a prefill worker's held blocks by id under the
        owner's request id instead of hashes (no region file). Raises like get_blocks, and DataPlaneError when
        the peer has no region, is on another host, or runs no transfer engine. Release with release_lease."""
        hashes, ids = [bytes(h) for h in block_hashes], [int(i) for i in block_ids]
        request = FrameHeader(op=FrameOp.LEASE, correlation_id=self._new_correlation_id(), layout_id=layout_id,
                              block_hashes=hashes, host_id=host_id, via=via, request_id=request_id, block_ids=ids)
        reply, _ = await self._request(request, [], None)
        num_blocks = len(ids) or len(hashes)
        if len(reply.slots) != num_blocks or not reply.lease_id or not (reply.region_path or ids):
            raise DataPlaneError(f"{self.address} answered a lease of {len(reply.slots)} slots for {num_blocks}")
        if via == LeaseVia.TRANSFER_ENGINE and reply.remote_region is None:
            raise DataPlaneError(f"{self.address} answered a transfer-engine lease without its remote region")
        return reply

    async def release_lease(self, lease_id: str) -> None:
        """End a lease: the peer may rewrite its slots."""
        await self._request(FrameHeader(op=FrameOp.RELEASE, correlation_id=self._new_correlation_id(),
                                        lease_id=lease_id), [], None)

    async def close(self) -> None:
        """Close the connection (a later call would reconnect)."""
        async with self._lock:
            await self._drop()

    def _new_correlation_id(self) -> int:
        self._next_correlation_id += 1
        return self._next_correlation_id - 1

    async def _request(
        self,
        request: FrameHeader,
        payloads: Sequence[memoryview],
        labels: Sequence[str] | None,
        into: Sequence[memoryview] | None = None,
    ) -> tuple[FrameHeader, list[BytesLike]]:
        """One round trip under the lock; the connection is dropped on anything but a complete reply."""
        buffers = frame_buffers(request, payloads, self.limits)  # FrameTooLarge before anything is sent
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    reply, blocks, checksums = await self._round_trip(buffers, into)
                if reply.correlation_id != request.correlation_id:
                    raise FrameError(
                        f"reply for request {reply.correlation_id}, expected {request.correlation_id}"
                    )
                if labels is not None and reply.op == FrameOp.REPLY:
                    check_checksums(checksums, reply, labels)
            except BaseException as exc:
                await self._drop()
                if isinstance(exc, TimeoutError) and not isinstance(exc, DataPlaneError):
                    raise DataPlaneTimeout(
                        f"{request.op} on {self.address} took over {self.timeout_s:g} s"
                    ) from exc
                raise
        self.metrics.requests += 1
        self.metrics.bytes_sent += request.payload_bytes
        self.metrics.blocks_sent += request.num_blocks
        self.metrics.bytes_received += reply.payload_bytes
        self.metrics.blocks_received += reply.num_blocks
        if reply.op == FrameOp.ERROR:
            self.metrics.errors += 1
            raise error_from_code(reply.error_code, f"{self.address}: {reply.error_message}")
        return reply, blocks

    async def _round_trip(
        self, buffers: list[BytesLike], into: Sequence[memoryview] | None
    ) -> tuple[FrameHeader, list[BytesLike], list[int]]:
        for attempt in range(2):
            reused = self._writer is not None
            reader, writer = await self._connection()
            try:
                await write_frame(writer, buffers)
                reply = await read_header(reader, self.limits)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await self._drop()
                # A reused connection may have been closed by the peer while idle: requests are idempotent
                # (reads, and puts of content-addressed blocks), so retry once on a fresh one.
                if reused and attempt == 0:
                    continue
                raise DataPlaneConnectionError(f"{self.address} closed the connection: {exc!r}") from exc
            try:
                return reply, *await _read_blocks(reader, reply, into)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise DataPlaneConnectionError(
                    f"{self.address} closed the connection mid-reply: {exc!r}"
                ) from exc
        raise AssertionError("unreachable")

    async def _connection(self) -> tuple[BlockStream, BlockStream]:
        if self._reader is not None and self._writer is not None and not self._reader.at_eof():
            return self._reader, self._writer
        await self._drop()
        try:
            _, stream = await asyncio.get_running_loop().create_connection(BlockStream, self.host, self.port)
            reader = writer = stream
        except OSError as exc:
            raise DataPlaneConnectionError(
                f"cannot connect to the data plane at {self.address}: {exc}"
            ) from exc
        try:
            await client_handshake(reader, writer, self._key)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            raise DataPlaneConnectionError(
                f"{self.address} closed the connection in the handshake: {exc!r}"
            ) from exc
        except BaseException:
            writer.close()
            raise
        self._reader, self._writer = reader, writer
        return reader, writer

    async def _drop(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _read_blocks(
    stream: BlockStream, reply: FrameHeader, into: Sequence[memoryview] | None
) -> tuple[list[BytesLike], list[int]]:
    """The reply's blocks (into the caller's buffers when given) and each one's xxh3-64, taken as it lands."""
    if reply.op != FrameOp.REPLY or into is None:
        blocks: list[BytesLike] = [await stream.readexactly(size) for size in reply.sizes]
        return blocks, [checksum(block) for block in blocks]
    if len(reply.sizes) != len(into):
        raise FrameError(f"reply carries {len(reply.sizes)} blocks for {len(into)} buffers")
    checksums = []
    for size, buffer in zip(reply.sizes, into, strict=True):
        if size != buffer.nbytes:
            raise FrameError(f"reply block of {size} bytes for a buffer of {buffer.nbytes}")
        await stream.readinto(buffer)
        checksums.append(checksum(buffer))
    return list(into), checksums
