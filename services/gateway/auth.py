"""API keys: held only as SHA-256 digests, compared in constant time; the tenant (and its cache salt) is the digest.

    keys = KeyRing.from_settings(settings)      # api_keys (plain or "sha256:<hex>") + api_keys_file
    tenant = keys.tenant_of(token)              # the key's digest (hex), or None for an unknown key
    salt = cache_salt(tenant, body.cache_salt)  # a body salt only narrows the tenant's, never replaces it

A keys file holds one key per line: `sha256:<64 hex digits>` (the key's digest, `printf %s "$KEY" | sha256sum`, so
the file need not hold any key itself) or a plain key; blank lines and `#` comments are skipped.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from deepinfer.config import GatewaySettings

HASH_PREFIX = "sha256:"
_DIGEST_HEX_CHARS = 64


class KeyFileError(ValueError):
    """A keys-file line that is neither a plain key nor `sha256:` and 64 hex digits."""


def key_digest(key: str) -> bytes:
    """SHA-256 of a key (UTF-8)."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_key(entry: str) -> bytes:
    """The digest an entry stands for: `sha256:<hex>` as given, any other text as a plain key."""
    if not entry.startswith(HASH_PREFIX):
        return key_digest(entry)
    hex_digest = entry[len(HASH_PREFIX):].strip().lower()
    if len(hex_digest) != _DIGEST_HEX_CHARS or any(c not in "0123456789abcdef" for c in hex_digest):
        raise KeyFileError(f"{HASH_PREFIX} must be followed by 64 hex digits (a SHA-256 of the key)")
    return bytes.fromhex(hex_digest)


def read_keys_file(path: Path) -> list[bytes]:
    """The digests of a keys file (one key or `sha256:<hex>` per line; blank lines and # comments skipped)."""
    digests = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        try:
            digests.append(parse_key(entry))
        except KeyFileError as exc:
            raise KeyFileError(f"{path}:{number}: {exc}") from None
    return digests


class KeyRing:
    """The accepted keys, as digests only (a memory dump shows no key)."""

    def __init__(self, digests: Iterable[bytes]) -> None:
        self.digests = tuple(dict.fromkeys(digests))

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> KeyRing:
        """api_keys (plain keys or `sha256:<hex>`) plus the entries of api_keys_file when set."""
        digests = [parse_key(entry) for entry in settings.api_keys]
        if settings.api_keys_file is not None:
            digests += read_keys_file(settings.api_keys_file)
        return cls(digests)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def tenant_of(self, token: str) -> str | None:
        """The tenant id (the key's digest, hex) of an accepted key, else None. Every stored digest is compared,
        each in constant time, so the time taken says nothing of which key or how much of it matched."""
        digest = key_digest(token)
        found = None
        for known in self.digests:
            if hmac.compare_digest(digest, known):
                found = known
        return None if found is None else found.hex()


def cache_salt(tenant: str | None, body_salt: str | None) -> str:
    """The salt of a request's KV blocks: the tenant's (its key digest; "" without auth), narrowed by a body
    `cache_salt` (hashed together with it), so no body value can reproduce another tenant's salt."""
    if body_salt is None:
        return tenant or ""
    if tenant is None:
        return body_salt
    return hashlib.sha256(f"{tenant}\0{body_salt}".encode()).hexdigest()
