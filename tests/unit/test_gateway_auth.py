"""API keys: every API route needs one, keys are held hashed (a keys file may hold only digests), and the cache
salt is the key's: a body cache_salt narrows it and can never reproduce another key's."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from deepinfer.protocol import WorkerRole
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import worker_load
from services.gateway.auth import KeyFileError, KeyRing, cache_salt, read_keys_file
from tests.gateway_harness import MODEL, Harness, make_harness

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 2}]}
#: Routes answered without a key (load balancers probe them), as documented in docs/gateway.md.
OPEN_ROUTES = {"/health", "/version"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_keys_are_held_only_as_digests(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team a\nsha256:{_digest('sk-file').upper()}\n\n  sk-plain-in-file  \n")
    ring = KeyRing([*read_keys_file(keys_file), bytes.fromhex(_digest("sk-env"))])
    assert all(isinstance(d, bytes) and len(d) == 32 for d in ring.digests)
    assert b"sk-" not in b"".join(ring.digests)
    assert ring.tenant_of("sk-file") == _digest("sk-file")
    assert ring.tenant_of("sk-plain-in-file") == _digest("sk-plain-in-file")
    assert ring.tenant_of("sk-env") == _digest("sk-env")
    assert ring.tenant_of("sk-fil") is None and ring.tenant_of("") is None
    keys_file.write_text("sha256:abc\n")
    with pytest.raises(KeyFileError, match=r"keys:1: sha256: must be followed by 64 hex digits"):
        read_keys_file(keys_file)


async def test_plain_keys_and_a_hash_only_keys_file_both_authenticate(model_dir: Path, tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"sha256:{_digest('sk-hashed')}\n")
    h = await make_harness(model_dir, settings={"api_keys": ["sk-plain", f"sha256:{_digest('sk-env-hashed')}"],
                                                "api_keys_file": keys_file})
    for key in ("sk-plain", "sk-hashed", "sk-env-hashed"):
        models = await h.openai(key).models.list()
        assert [m.id for m in models.data] == [MODEL]
    async with h.http() as http:
        hashed_as_key = await http.get("/v1/models", headers={"Authorization": f"Bearer sha256:{_digest('sk-hashed')}"})
    assert hashed_as_key.status_code == 401  # the digest itself is not a key
    await h.fake.stop()


def _api_routes(h: Harness) -> list[tuple[str, str]]:
    """(method, path with its parameters filled in) for every route of the app."""
    routes = []
    for route in h.app.routes:
        if isinstance(route, APIRoute) or hasattr(route, "methods"):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            routes += [(method, path) for method in sorted(route.methods or []) if method != "HEAD"]
    return routes


async def test_every_api_route_needs_a_key(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-good"]})
    routes = _api_routes(h)
    assert {path for _, path in routes} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    async with h.http() as http:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "Basic sk-good"},
                            {"x-api-key": "sk-bad"}):
                response = await http.request(method, path, json=CHAT, headers=headers)
                if path in OPEN_ROUTES:
                    assert response.status_code != 401, (method, path)
                    continue
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                if path == "/v1/messages":  # Anthropic's error shape
                    assert error["type"] == "authentication_error"
                else:
                    assert error["code"] == "invalid_api_key"
            for good in ({"Authorization": "Bearer sk-good"}, {"x-api-key": "sk-good"}):
                response = await http.request(method, path, json=CHAT, headers=good)
                assert response.status_code != 401, (method, path)
    await h.fake.stop()


def test_a_body_salt_narrows_and_never_replaces_the_tenants():
    a, b = _digest("sk-a"), _digest("sk-b")
    assert cache_salt(a, None) == a and cache_salt(None, None) == ""
    assert cache_salt(b, a) not in {a, b} and cache_salt(b, "x") != cache_salt(a, "x")
    assert cache_salt(a, "x") != cache_salt(a, "y")


async def test_a_body_cache_salt_cannot_hit_another_keys_cached_prompt(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-a", "sk-b"]})
    for worker_id, role in (("prefill-0", WorkerRole.PREFILL), ("decode-0", WorkerRole.DECODE)):
        h.workers.observe(worker_load(worker_id, role, MODEL, model_fingerprint=b"\x07" * 32, block_size=16))
    await h.openai("sk-a").chat.completions.create(**CHAT)
    await h.openai("sk-a").chat.completions.create(**CHAT, extra_body={"cache_salt": "shared"})
    cached_by_a = {bytes(x) for r in h.fake.route_requests for x in r.block_hashes}
    assert cached_by_a
    # key b tries a's salt (the digest of a's key, which b may guess), a's body salt, and nothing
    for salt in (_digest("sk-a"), "shared", None):
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        await h.openai("sk-b").chat.completions.create(**CHAT, **extra)
        (route,) = h.fake.route_requests[-1:]
        assert route.block_hashes and not {bytes(x) for x in route.block_hashes} & cached_by_a, salt
    await h.fake.stop()


async def test_a_wrong_key_is_never_outvoted_by_a_right_one(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-a", "sk-b"]})
    async with h.http() as http:
        for headers, status in (
            ({"Authorization": "Bearer sk-a", "x-api-key": "sk-a"}, 200),
            ({"Authorization": "Bearer sk-a", "x-api-key": "sk-wrong"}, 401),
            ({"Authorization": "Bearer sk-wrong", "x-api-key": "sk-a"}, 401),
            ({"Authorization": "Bearer sk-a", "x-api-key": "sk-b"}, 401),  # two tenants: which one?
            ({"Authorization": "Basic sk-a", "x-api-key": "sk-a"}, 401),
        ):
            response = await http.get("/v1/models", headers=headers)
            assert response.status_code == status, headers
    await h.fake.stop()
