"""Composition root of a kvcache shard: settings → runtime (bus, telemetry, signals) → handler."""

from __future__ import annotations

from deepinfer.config import KvCacheSettings
from deepinfer.service import ServiceContext, service_main
from services.kvcache.handler import KvCacheHandler


async def build(ctx: ServiceContext[KvCacheSettings]) -> KvCacheHandler:
    """Open the store (the index is rebuilt from the segments on disk) and bind the data plane."""
    handler = KvCacheHandler(ctx)
    await handler.open()
    assert handler.data_plane is not None
    ctx.advertise_port("data_plane", handler.data_plane.port)
    return handler


def main() -> int:
    """`python -m services.kvcache` / `deepinfer serve kvcache`: run until SIGTERM; the exit code."""
    return service_main(KvCacheSettings, build)
