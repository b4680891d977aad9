"""DataPlaneServer: serves a BlockProvider's KV blocks over authenticated, length-prefixed TCP frames.

One task per connection runs `read frame → call provider → write reply`, one request at a time (clients
serialise their requests per connection). Many connections are served concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from deepinfer.dataplane.auth import secret_key, server_handshake
from deepinfer.dataplane.errors import DataPlaneAuthError, DataPlaneError, FrameError
from deepinfer.dataplane.frames import (
    LENGTH_PREFIX_BYTES,
    FrameHeader,
    FrameLimits,
    FrameOp,
    LeaseVia,
    SlotGrant,
    byte_view,
    check_checksums,
    check_limits,
    frame_buffers,
    payload_fields,
    read_header,
    receive_blocks,
    write_frame,
)
from deepinfer.dataplane.metrics import DataPlaneMetrics
from deepinfer.dataplane.provider import BlockProvider, call_provider
from deepinfer.dataplane.puts import PutPipeline, takes_checksums
from deepinfer.dataplane.stream import BlockStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTimeouts:
    """How long a peer may take at each stage before its connection is dropped."""

    handshake_s: float = 5.0
    #: An authenticated connection with no request for this long is closed (the client reconnects).
    idle_s: float = 300.0
    #: From a request's length prefix to the last byte of its reply, provider call included.
    request_s: float = 60.0


@dataclass(eq=False)
class _Connection:
    peer: str = field(default="?")
    busy: bool = False
    task: asyncio.Task[None] = field(init=False)


class DataPlaneServer:
    """Serve `provider` on host:port (127.0.0.1 and a free port by default) to clients holding `secret`.

    Lifecycle: `address = await start()` → serve → `await close()` (stops accepting, finishes in-flight
    requests, closes idle connections). Without a secret it refuses to start unless `allow_insecure=True`.
    """

    def __init__(
        self,
        provider: BlockProvider,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        *,
        allow_insecure: bool = False,
        limits: FrameLimits | None = None,
        timeouts: ServerTimeouts | None = None,
        max_connections: int = 256,
    ) -> None:
        if secret is None and not allow_insecure:
            raise ValueError(
                "DataPlaneServer needs a shared secret; pass allow_insecure=True only for a private test setup"
            )
        self.provider = provider
        self.host = host
        self.port = port
        self.limits = limits or FrameLimits()
        self.timeouts = timeouts or ServerTimeouts()
        self.max_connections = max_connections
        self.metrics = DataPlaneMetrics()
        self._key = secret_key(secret)
        self._server: asyncio.Server | None = None
        #: The provider takes the checksums the server verified (and need not compute them again).
        self._pass_checksums = takes_checksums(provider)
        #: The provider takes a put as several write_blocks calls, made while the frame arrives (dataplane/puts.py).
        self._incremental_writes = bool(getattr(provider, "incremental_writes", False))
        self._connections: set[_Connection] = set()
        self._closing = False

    @property
    def address(self) -> str:
        """ "host:port" the server listens on (after start)."""
        if self._server is None:
            raise RuntimeError("DataPlaneServer is not started")
        return _format_address(self.host, self.port)

    async def start(self) -> str:
        """Bind and listen; returns the bound "host:port" (the real port when port=0)."""
        if self._server is not None:
            raise RuntimeError("DataPlaneServer already started")
        # BlockStream: each block is received straight into the buffer it will live in (dataplane/stream.py).
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: BlockStream(self._on_stream), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("data plane listening on %s", self.address)
        return self.address

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to drain_timeout_s), close every connection."""
        if self._server is None or self._closing:
            return
        self._closing = True
        self._server.close()
        for conn in list(self._connections):
            if not conn.busy:
                conn.task.cancel()
        tasks = [conn.task for conn in self._connections]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for task in pending:
                logger.warning(
                    "data plane: request still running after %.1f s at close; cancelling", drain_timeout_s
                )
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await self._server.wait_closed()

    def _on_stream(self, stream: BlockStream) -> None:
        if self._closing or len(self._connections) >= self.max_connections:
            stream.close()
            return
        conn = _Connection(peer=str(stream.get_extra_info("peername")))
        conn.task = asyncio.get_running_loop().create_task(self._on_connect(conn, stream))
        self._connections.add(conn)

    async def _on_connect(self, conn: _Connection, stream: BlockStream) -> None:
        try:
            await self._serve_connection(conn, stream)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away or stalled: nothing to answer
        except Exception:
            logger.exception("data plane: connection from %s failed", conn.peer)
        finally:
            self._connections.discard(conn)
            stream.close()
            with contextlib.suppress(Exception):
                await stream.wait_closed()

    async def _serve_connection(self, conn: _Connection, stream: BlockStream) -> None:
        try:
            async with asyncio.timeout(self.timeouts.handshake_s):
                await server_handshake(stream, stream, self._key)
        except DataPlaneAuthError as exc:
            self.metrics.auth_failures += 1
            logger.warning("data plane: refused %s: %s", conn.peer, exc)
            return
        self.metrics.connections += 1
        while not self._closing:
            async with asyncio.timeout(self.timeouts.idle_s):
                prefix = await stream.readexactly(LENGTH_PREFIX_BYTES)
            conn.busy = True
            try:
                async with asyncio.timeout(self.timeouts.request_s):
                    keep_open = await self._serve_request(prefix, stream)
            finally:
                conn.busy = False
            if not keep_open:
                return

    async def _serve_request(self, prefix: bytes, stream: BlockStream) -> bool:
        """Answer one request; False when the stream can no longer be trusted and must be closed."""
        self.metrics.requests += 1
        correlation_id = 0
        in_sync = False  # becomes True once the whole request frame has been consumed
        try:
            request = await read_header(stream, self.limits, prefix)
            correlation_id = request.correlation_id
            pipeline = self._put_pipeline(request)
            try:
                blocks, checksums = await receive_blocks(stream, request, pipeline and pipeline.add)
            except BaseException:
                if pipeline is not None:
                    pipeline.cancel()
                raise
            in_sync = True
            self.metrics.bytes_received += request.payload_bytes
            self.metrics.blocks_received += len(blocks)
            if pipeline is not None:
                await pipeline.finish()
                reply, payloads = FrameHeader(op=FrameOp.REPLY, correlation_id=correlation_id), []
            else:
                reply, payloads = await self._dispatch(request, blocks, checksums)
        except DataPlaneError as exc:
            self.metrics.errors += 1
            if isinstance(exc, FrameError):
                logger.warning("data plane: bad frame: %s", exc)
            reply, payloads = _error_reply(correlation_id, exc.code, str(exc)), []
        except Exception as exc:
            if not in_sync:
                raise
            self.metrics.errors += 1
            logger.exception("data plane: provider failed on request %d", correlation_id)
            reply, payloads = _error_reply(correlation_id, "internal", f"{type(exc).__name__}: {exc}"), []
        await write_frame(stream, frame_buffers(reply, payloads, self.limits))
        self.metrics.bytes_sent += reply.payload_bytes
        self.metrics.blocks_sent += reply.num_blocks
        return in_sync

    def _put_pipeline(self, request: FrameHeader) -> PutPipeline | None:
        """A pipeline for a well-formed put to a provider that takes incremental writes, else None."""
        if not self._incremental_writes or request.op != FrameOp.PUT or request.num_blocks == 0:
            return None
        if len(request.block_hashes) != request.num_blocks:
            return None  # refused by _dispatch once the frame has been read
        return PutPipeline(self.provider, request, _hash_labels(request))

    async def _dispatch(
        self, request: FrameHeader, blocks: list[memoryview], checksums: list[int]
    ) -> tuple[FrameHeader, list[memoryview]]:
        cid = request.correlation_id
        if request.op == FrameOp.GET:
            return await self._get(request)
        if request.op == FrameOp.PUT:
            labels = _hash_labels(request)
            if len(request.block_hashes) != len(blocks):
                raise FrameError(f"put of {len(blocks)} blocks names {len(request.block_hashes)} hashes")
            check_checksums(checksums, request, labels)
            extra = {"checksums": checksums} if self._pass_checksums else {}
            await call_provider(
                self.provider.write_blocks,
                layout_id=request.layout_id,
                block_hashes=request.block_hashes,
                payloads=blocks,
                **extra,
            )
            return FrameHeader(op=FrameOp.REPLY, correlation_id=cid), []
        if request.op == FrameOp.HAS:
            present = await call_provider(
                self.provider.has_blocks, layout_id=request.layout_id, block_hashes=request.block_hashes
            )
            present = [bool(p) for p in present]
            if len(present) != len(request.block_hashes):
                raise DataPlaneError(
                    f"provider answered {len(present)} flags for {len(request.block_hashes)} hashes"
                )
            return FrameHeader(op=FrameOp.REPLY, correlation_id=cid, present=present), []
        if request.op in (FrameOp.LEASE, FrameOp.RELEASE):
            return await self._lease(request), []
        raise FrameError(f"op {request.op!r} is not a request")

    async def _lease(self, request: FrameHeader) -> FrameHeader:
        """lease / release of slots, for a provider that has them: the store's shared-memory RAM tier (by hash),
        a prefill worker's handoff exports (by block id under a request id, via a transfer engine)."""
        cid = request.correlation_id
        if request.op == FrameOp.RELEASE:
            release = getattr(self.provider, "release_lease", None)
            if release is not None:
                await call_provider(release, lease_id=request.lease_id)
            return FrameHeader(op=FrameOp.REPLY, correlation_id=cid)
        lease_blocks = getattr(self.provider, "lease_blocks", None)
        if lease_blocks is None:
            raise DataPlaneError("this peer leases no shared memory")
        via = {} if request.via == LeaseVia.SHARED_MEMORY else {"via": request.via}  # older providers: no `via`
        if request.block_ids:  # a worker's held blocks by id under the owner's request id (the store has none)
            via |= {"request_id": request.request_id, "block_ids": request.block_ids}
        lease = await call_provider(lease_blocks, layout_id=request.layout_id, block_hashes=request.block_hashes,
                                    host_id=request.host_id, **via)
        slots = [SlotGrant(slot=r.slot, seq=r.seq, size=r.size, checksum=r.checksum, key_digest=r.key_digest)
                 for r in lease.refs]
        return FrameHeader(op=FrameOp.REPLY, correlation_id=cid, lease_id=lease.lease_id,
                           region_path=lease.region_path, slots=slots, via=request.via,
                           remote_region=getattr(lease, "remote_region", None))

    async def _get(self, request: FrameHeader) -> tuple[FrameHeader, list[memoryview]]:
        ids, hashes = request.block_ids, request.block_hashes
        if ids and hashes and len(ids) != len(hashes):
            raise FrameError(f"get names {len(ids)} block ids but {len(hashes)} hashes")
        num_requested = len(ids) or len(hashes)
        buffers = await call_provider(
            self.provider.read_blocks,
            request_id=request.request_id,
            block_ids=ids,
            block_hashes=hashes,
            layout_id=request.layout_id,
        )
        payloads = [byte_view(b) for b in buffers]
        if len(payloads) != num_requested:
            raise DataPlaneError(f"provider returned {len(payloads)} blocks for {num_requested} requested")
        reply = FrameHeader(
            op=FrameOp.REPLY, correlation_id=request.correlation_id, **payload_fields(payloads)
        )
        check_limits(reply, self.limits)  # FrameTooLarge: the client should ask for fewer blocks per request
        return reply, payloads


def _hash_labels(request: FrameHeader) -> list[str]:
    return [f"hash {h.hex()}" for h in request.block_hashes]


def _error_reply(correlation_id: int, code: str, message: str) -> FrameHeader:
    return FrameHeader(
        op=FrameOp.ERROR, correlation_id=correlation_id, error_code=code, error_message=message
    )


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["DataPlaneServer", "ServerTimeouts"]
