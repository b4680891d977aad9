"""BlockingPutClient: data-plane puts over a blocking socket, for a writer thread (a worker's write-behind).

    writer thread: connect + handshake (once, reused) ─► per put frame: checksums of the blocks ─► header ─►
                   each block's buffer straight to `sendall` (the kernel copies from the caller's memory, the GIL
                   released meanwhile) ─► the reply header

The event loop's transport copies what the socket does not take at once into its own buffer and moves the rest
down after every send (asyncio before 3.12): for MiB of KV a put, most of its cost, all of it holding the GIL on
the event loop. Here nothing is copied in user space and the loop is not involved. Same frames, handshake and
errors as DataPlaneClient (which the reads keep using); one frame in flight, one caller at a time (a lock); any
failure mid-frame closes the socket and the next put reconnects (a reused socket the peer closed while idle is
retried once: puts of content-addressed blocks are idempotent). Every socket operation is bounded by `timeout_s`.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import threading
from collections.abc import Sequence

from deepinfer.dataplane.auth import ACCEPT, MAGIC, NONCE_BYTES, PROOF_BYTES, _proof
from deepinfer.dataplane.client import PeerConnection
from deepinfer.dataplane.errors import (
    DataPlaneAuthError,
    DataPlaneConnectionError,
    DataPlaneTimeout,
    FrameError,
    error_from_code,
)
from deepinfer.dataplane.frames import (
    LENGTH_PREFIX_BYTES,
    BytesLike,
    FrameHeader,
    FrameLimits,
    FrameOp,
    byte_view,
    decode_header,
    encode_header,
    header_length,
    payload_fields,
)


class BlockingPutClient(PeerConnection):
    """Puts blocks on one peer's data plane ("host:port") from a thread; `close()` from any thread."""

    def __init__(self, address: str, secret: str | bytes | None, timeout_s: float = 10.0, *,
                 limits: FrameLimits | None = None, max_blocks_per_request: int = 64) -> None:
        super().__init__(address, secret, timeout_s, limits, max_blocks_per_request)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False

    def put_blocks(self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[BytesLike]) -> None:
        """Store blocks on the peer by (layout_id, hash), as DataPlaneClient.put_blocks (blocking)."""
        if len(block_hashes) != len(payloads):
            raise ValueError(f"{len(block_hashes)} block_hashes but {len(payloads)} payloads")
        views = [byte_view(p) for p in payloads]
        with self._lock:
            for start in range(0, len(views), self.max_blocks_per_request):
                chunk = views[start : start + self.max_blocks_per_request]
                request = FrameHeader(op=FrameOp.PUT, correlation_id=self._next_correlation_id, layout_id=layout_id,
                                      block_hashes=[bytes(h) for h in block_hashes[start : start + len(chunk)]],
                                      **payload_fields(chunk))
                self._next_correlation_id += 1
                self._request([encode_header(request, self.limits), *chunk], request)

    def close(self) -> None:
        """Close for good: a put blocked in another thread fails at once, a later one raises."""
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        """Close the socket after a failure (the next put reconnects)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in send or recv (close alone may not)
            sock.close()

    def _request(self, buffers: list[BytesLike], request: FrameHeader) -> None:
        try:
            reply = self._round_trip(buffers)
            if reply.correlation_id != request.correlation_id:
                raise FrameError(f"reply for request {reply.correlation_id}, expected {request.correlation_id}")
            if reply.num_blocks:
                raise FrameError(f"{self.address} answered a put with {reply.num_blocks} blocks")
        except TimeoutError as exc:
            self._drop()
            raise DataPlaneTimeout(f"put on {self.address} took over {self.timeout_s:g} s") from exc
        except BaseException:
            self._drop()
            raise
        self.metrics.requests += 1
        self.metrics.bytes_sent += request.payload_bytes
        self.metrics.blocks_sent += request.num_blocks
        if reply.op == FrameOp.ERROR:
            self.metrics.errors += 1
            raise error_from_code(reply.error_code, f"{self.address}: {reply.error_message}")

    def _round_trip(self, buffers: list[BytesLike]) -> FrameHeader:
        for attempt in range(2):
            reused = self._sock is not None
            sock = self._connection()
            try:
                for buffer in buffers:
                    sock.sendall(buffer)
                prefix = _recv_exactly(sock, LENGTH_PREFIX_BYTES)
            except ConnectionError as exc:
                self._drop()
                if reused and attempt == 0:
                    continue
                raise DataPlaneConnectionError(f"{self.address} closed the connection: {exc!r}") from exc
            try:
                return decode_header(_recv_exactly(sock, header_length(prefix, self.limits)), self.limits)
            except ConnectionError as exc:
                raise DataPlaneConnectionError(f"{self.address} closed the connection mid-reply: {exc!r}") from exc
        raise AssertionError("unreachable")

    def _connection(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self._closed:
            raise DataPlaneConnectionError(f"the put client of {self.address} is closed")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except TimeoutError:
            raise
        except OSError as exc:
            raise DataPlaneConnectionError(f"cannot connect to the data plane at {self.address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _handshake(sock, self._key)
        except ConnectionError as exc:
            sock.close()
            raise DataPlaneConnectionError(f"{self.address} closed the connection in the handshake: {exc!r}") from exc
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock


def _handshake(sock: socket.socket, key: bytes) -> None:
    """auth.client_handshake over a blocking socket."""
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if hello[: len(MAGIC)] != MAGIC:
        raise DataPlaneAuthError(f"peer is not a deepinfer data plane (greeting {hello[: len(MAGIC)]!r})")
    server_nonce = hello[len(MAGIC) :]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
    if _recv_exactly(sock, 1) != ACCEPT:
        raise DataPlaneAuthError("server refused the data-plane secret")
    if not hmac.compare_digest(_recv_exactly(sock, PROOF_BYTES), _proof(key, b"server", server_nonce, client_nonce)):
        raise DataPlaneAuthError("server failed to prove the data-plane secret (wrong secret on the server)")


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes; ConnectionResetError when the peer closes first."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        received = sock.recv_into(view[got:])
        if not received:
            raise ConnectionResetError(f"peer closed after {got} of {n} bytes")
        got += received
    return bytes(buffer)


__all__ = ["BlockingPutClient"]
