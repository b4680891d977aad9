"""What a data-plane server serves from: the BlockProvider Protocol, and how the server calls it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from deepinfer.dataplane.frames import BytesLike

T = TypeVar("T")


class BlockProvider(Protocol):
    """Source and sink of KV blocks behind a DataPlaneServer (a worker's KV pool, the store's tiers).

    Each method may be a coroutine function (awaited on the server's loop) or a plain function (run on a
    worker thread so a device->host copy never blocks the loop; make it thread-safe). Raise the data plane's
    typed errors: `LeaseExpired` for an unknown or ended lease, `BlockNotFound` for a missing block,
    `DataPlaneError` for an op this provider does not serve; they reach the client as the same class.

    Optional, for a provider whose blocks live in shared memory (the store with `shm_dir`):
    `lease_blocks(layout_id, block_hashes, host_id)` returns a `deepinfer.kvcache.shm.SlotLease` (lease_id,
    region_path, one SlotRef per hash), and `release_lease(lease_id)` ends it; without them `lease` is refused.
    """

    def read_blocks(
        self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], layout_id: str
    ) -> Sequence[BytesLike] | Awaitable[Sequence[BytesLike]]:
        """One payload per requested block, in request order.

        By block id within the lease `request_id` (a worker), by hash (the store), or both: then block id i
        must still hold hash i, else LeaseExpired (the block was reused; its bytes are another prefix's).
        """
        ...

    def write_blocks(
        self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[bytes]
    ) -> None | Awaitable[None]:
        """Store blocks by (layout_id, hash); checksums were verified before the call."""
        ...

    def has_blocks(
        self, layout_id: str, block_hashes: Sequence[bytes]
    ) -> Sequence[bool] | Awaitable[Sequence[bool]]:
        """One flag per hash: is the block held under this layout?"""
        ...


async def call_provider(method: Callable[..., Any], **kwargs: Any) -> Any:
    """Await a coroutine method; run a plain one on a worker thread."""
    if inspect.iscoroutinefunction(method):
        return await method(**kwargs)
    result = await asyncio.to_thread(method, **kwargs)
    if inspect.isawaitable(result):  # a plain function that returned an awaitable (e.g. a functools.partial)
        return await result
    return result
