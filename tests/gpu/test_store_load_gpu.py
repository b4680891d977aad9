"""Store loads on CUDA (written without a GPU at hand; run it on one): a StagingPool's pinned rows imported with
import_rows (one host→device copy and one Triton scatter_blocks of every layer, on the current stream) write
export_blocks' bytes exactly, both cache layouts, bf16 and fp32; a chunk is lent again only once the copy that
reads its rows has completed, so rows overwritten after that never reach the cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from deepinfer.engine.kv_transfer import StagingPool, block_nbytes, export_blocks, import_blocks, import_rows  # noqa: E402
from deepinfer.kernels import get_ops  # noqa: E402
from deepinfer.kernels.torch_block_copy import layer_table  # noqa: E402


def _caches(latent: bool, dtype: torch.dtype, num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    shape = (num_blocks, 16, 96) if latent else (2, num_blocks, 16, 4, 64)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(4)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype=dtype, device="cuda") for _ in range(4)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pinned_rows_import_like_import_blocks(latent, dtype):
    source = _caches(latent, dtype, 40, seed=1)
    ids = [5, 1, 17, 33, 2, 9, 21]
    payloads = export_blocks(source, ids)
    pool = StagingPool(block_nbytes(source), chunk_blocks=8, num_chunks=1, pin=True)

    async def load(target: list[torch.Tensor]) -> None:
        chunk = await pool.acquire()
        assert chunk.rows.is_pinned()
        for view, payload in zip(chunk.views, payloads, strict=False):
            view[:] = payload
        done = import_rows(target, [3, 30, 7, 11, 38, 4, 25], chunk.rows[: len(ids)], get_ops("cuda"),
                           layer_table(target))
        assert isinstance(done, torch.cuda.Event)
        pool.release(chunk, done)

    by_rows, by_blocks = _caches(latent, dtype, 40, None), _caches(latent, dtype, 40, None)
    asyncio.run(load(by_rows))
    import_blocks(by_blocks, [3, 30, 7, 11, 38, 4, 25], payloads)
    torch.cuda.synchronize()
    for a, b in zip(by_rows, by_blocks, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_a_chunk_is_lent_again_only_after_its_copy_completed():
    source = _caches(False, torch.bfloat16, 65, seed=2)
    ids = list(range(1, 65))
    payloads = export_blocks(source, ids)
    pool = StagingPool(block_nbytes(source), chunk_blocks=64, num_chunks=1, pin=True)
    target = _caches(False, torch.bfloat16, 65, None)

    async def run() -> None:
        chunk = await pool.acquire()
        for view, payload in zip(chunk.views, payloads, strict=True):
            view[:] = payload
        torch.cuda._sleep(50_000_000)  # the stream is busy: the copy below completes well after it is issued
        pool.release(chunk, import_rows(target, ids, chunk.rows, get_ops("cuda"), layer_table(target)))
        again = await pool.acquire()  # waits for that copy
        assert again is chunk and chunk.done is None
        chunk.rows.fill_(0)  # reused at once: must not reach the cache

    asyncio.run(run())
    torch.cuda.synchronize()
    for a, b in zip(target, source, strict=True):
        assert torch.equal(_bits(a[:, 1:]), _bits(b[:, 1:]))
