"""PutPipeline: blocks reach the provider while the frame arrives, calls batch themselves, the first error stops it."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.dataplane import ChecksumError, FrameHeader, FrameOp
from deepinfer.dataplane.frames import checksum
from deepinfer.dataplane.puts import PutPipeline, takes_checksums

BLOCKS = [bytes([i]) * (100 + i) for i in range(6)]
HASHES = [bytes([i + 1]) * 16 for i in range(6)]


class GatedProvider:
    """Records every write_blocks call; each call waits until the test opens the gate."""

    incremental_writes = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[bytes], list[bytes], list[int]]] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def write_blocks(self, layout_id, block_hashes, payloads, checksums) -> None:
        self.calls.append((list(block_hashes), [bytes(p) for p in payloads], list(checksums)))
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("disk full")


def _request() -> FrameHeader:
    return FrameHeader(
        op=FrameOp.PUT, correlation_id=1, layout_id="l", block_hashes=HASHES, num_blocks=6,
        sizes=[len(b) for b in BLOCKS], checksums=[checksum(b) for b in BLOCKS],
    )


def _add(pipeline: PutPipeline, index: int, corrupt: bool = False) -> None:
    block = BLOCKS[index]
    pipeline.add(index, memoryview(block), checksum(block) ^ corrupt)


async def test_blocks_queued_behind_a_running_call_go_in_the_next_one_together():
    provider = GatedProvider()
    pipeline = PutPipeline(provider, _request(), [f"#{i}" for i in range(6)])
    _add(pipeline, 0)
    await asyncio.sleep(0)  # the first call starts with block 0 alone and waits at the gate
    for i in range(1, 6):
        _add(pipeline, i)
    provider.gate.set()
    await pipeline.finish()
    assert [c[0] for c in provider.calls] == [HASHES[:1], HASHES[1:]]
    assert [p for c in provider.calls for p in c[1]] == BLOCKS
    assert [s for c in provider.calls for s in c[2]] == [checksum(b) for b in BLOCKS]  # passed on, verified


async def test_a_bad_checksum_stops_the_writing_at_that_block():
    provider = GatedProvider()
    provider.gate.set()
    pipeline = PutPipeline(provider, _request(), [f"hash-{i}" for i in range(6)])
    _add(pipeline, 0)
    _add(pipeline, 1)
    _add(pipeline, 2, corrupt=True)
    _add(pipeline, 3)
    with pytest.raises(ChecksumError, match=r"block hash-2 \(#2 of 6\)"):
        await pipeline.finish()
    assert [h for c in provider.calls for h in c[0]] == HASHES[:2]


async def test_a_failed_call_is_reported_once_the_frame_is_read_and_nothing_more_is_written():
    provider = GatedProvider()
    provider.fail = True
    pipeline = PutPipeline(provider, _request(), [f"#{i}" for i in range(6)])
    _add(pipeline, 0)
    await asyncio.sleep(0)
    provider.gate.set()
    await asyncio.sleep(0.01)
    for i in range(1, 6):
        _add(pipeline, i)
    with pytest.raises(RuntimeError, match="disk full"):
        await pipeline.finish()
    assert len(provider.calls) == 1


def test_the_store_takes_the_verified_checksums_and_a_plain_provider_does_not():
    from deepinfer.kvcache.store import KvStore
    from deepinfer.testing.dataplane import InMemoryBlockProvider

    assert takes_checksums(GatedProvider())
    assert KvStore.incremental_writes and "checksums" in KvStore.write_blocks.__code__.co_varnames
    assert not takes_checksums(InMemoryBlockProvider())
