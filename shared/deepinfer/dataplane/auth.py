"""Mutual shared-secret handshake of the data plane (HMAC-SHA256 over both sides' nonces).

    server -> client   MAGIC (5) ‖ server_nonce (32)
    client -> server   client_nonce (32) ‖ HMAC(secret, "client" ‖ server_nonce ‖ client_nonce)
    server -> client   ACCEPT (1) ‖ HMAC(secret, "server" ‖ server_nonce ‖ client_nonce)     or REFUSE (1), close

Fresh nonces from both sides defeat replay; the role labels stop a peer reflecting one side's proof back as
the other's. Every read is a fixed size, so nothing a peer sends before it is authenticated can make us
allocate. Proofs are compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from deepinfer.dataplane.errors import DataPlaneAuthError, DataPlaneConnectionError
from deepinfer.dataplane.stream import BlockStream

#: Protocol magic and version: "DIDP" then version 1.
MAGIC = b"DIDP\x01"
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
ACCEPT = b"\x01"
REFUSE = b"\x00"
#: A configured secret must be at least this long (a generated one is 32 random bytes as hex).
MIN_SECRET_BYTES = 16


def generate_secret() -> str:
    """A fresh random secret for a local stack (64 hex characters)."""
    return secrets.token_hex(32)


def secret_key(secret: str | bytes | None) -> bytes:
    """The HMAC key of a secret; None (insecure mode) is the empty key. ValueError for a short secret."""
    if secret is None:
        return b""
    key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"data-plane secret must be at least {MIN_SECRET_BYTES} bytes, got {len(key)}")
    return key


def _proof(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, role + server_nonce + client_nonce, hashlib.sha256).digest()


async def server_handshake(
    reader: asyncio.StreamReader | BlockStream, writer: asyncio.StreamWriter | BlockStream, key: bytes
) -> None:
    """Authenticate a connecting client, then prove ourselves; DataPlaneAuthError (after REFUSE) on failure."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(MAGIC + server_nonce)
    await writer.drain()
    answer = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
    client_nonce, client_proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(client_proof, _proof(key, b"client", server_nonce, client_nonce)):
        writer.write(REFUSE)
        await writer.drain()
        raise DataPlaneAuthError("client failed the data-plane handshake (wrong secret)")
    writer.write(ACCEPT + _proof(key, b"server", server_nonce, client_nonce))
    await writer.drain()


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """Prove the secret to the server and check its proof back; DataPlaneAuthError when either fails."""
    try:
        hello = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
    except asyncio.IncompleteReadError as exc:
        raise DataPlaneConnectionError("server closed the connection before the handshake") from exc
    if hello[: len(MAGIC)] != MAGIC:
        raise DataPlaneAuthError(f"peer is not a deepinfer data plane (greeting {hello[: len(MAGIC)]!r})")
    server_nonce = hello[len(MAGIC) :]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
    await writer.drain()
    try:
        status = await reader.readexactly(1)
    except asyncio.IncompleteReadError as exc:
        raise DataPlaneAuthError("server closed the connection during the handshake") from exc
    if status != ACCEPT:
        raise DataPlaneAuthError("server refused the data-plane secret")
    try:
        server_proof = await reader.readexactly(PROOF_BYTES)
    except asyncio.IncompleteReadError as exc:
        raise DataPlaneAuthError("server closed the connection before proving the secret") from exc
    if not hmac.compare_digest(server_proof, _proof(key, b"server", server_nonce, client_nonce)):
        raise DataPlaneAuthError("server failed to prove the data-plane secret (wrong secret on the server)")
