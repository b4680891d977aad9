"""Composition root of a kvcache shard: settings → runtime (bus, telemetry, signals) → handler."""

from __future__ import annotations

import logging

from deepinfer.config import KvCacheSettings
from deepinfer.config.loading import EXIT_BAD_CONFIG
from deepinfer.kvcache.store import StoreLockedError
from deepinfer.service import ServiceContext, service_main
from services.kvcache.handler import KvCacheHandler
from services.kvcache.malloc import keep_freed_buffers

log = logging.getLogger(__name__)


async def build(ctx: ServiceContext[KvCacheSettings]) -> KvCacheHandler:
    """Open the store (the index is rebuilt from the segments on disk) and bind the data plane."""
    handler = KvCacheHandler(ctx)
    try:
        await handler.open()
    except StoreLockedError as exc:
        # Another shard holds this directory: a configuration error, which restarting cannot cure.
        log.error("%s; give this shard its own DEEPINFER_KVCACHE_DISK_DIR or DEEPINFER_DATA_DIR", exc)
        raise SystemExit(EXIT_BAD_CONFIG) from exc
    assert handler.data_plane is not None
    ctx.advertise_port("data_plane", handler.data_plane.port)
    return handler


def main() -> int:
    """`python -m services.kvcache` / `deepinfer serve kvcache`: run until SIGTERM; the exit code."""
    keep_freed_buffers()  # before the store allocates its first block
    return service_main(KvCacheSettings, build)
