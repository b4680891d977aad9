"""Loading a prefix's KV into an engine as the store would (engine/kv_load.py), on a tiny model: the loaded
request gives the same tokens as a recompute while another request keeps stepping, with sync and async
scheduling; payloads that do not fit are refused and recomputed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.handoff import engine_stats
from deepinfer.engine.kv_load import export_cached, fail_load, finish_load, start_load
from deepinfer.engine.requests import EngineRequest
from deepinfer.hashing import hash_blocks
from deepinfer.sampling.params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 4 full blocks
OTHER = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(tiny_dir, **kw) -> EngineCore:
    # prefill_chunk_s=0: the steps asserted here are the token budget's, not cut by measured time
    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, kv_cache_bytes=16 << 20,
                                 prefill_chunk_s=0, **kw))


def run(core: EngineCore, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def stored(tiny_dir) -> tuple[list[int], list[bytes], list[bytes]]:
    """What a first worker computed and wrote behind: (reference tokens, block hashes, payloads)."""
    core = engine(tiny_dir)
    core.add_request("r", PROMPT, GREEDY)
    reference = run(core)["r"]
    hashes = hash_blocks(PROMPT, 4, core.fingerprint, "")
    kept, payloads = export_cached(core, hashes)
    assert kept == hashes and len(payloads) == 4
    return reference, hashes, payloads


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_loaded_prefix_gives_the_recomputed_tokens_while_others_run(tiny_dir, stored, async_scheduling):
    reference, hashes, payloads = stored
    core = engine(tiny_dir, async_scheduling=async_scheduling)
    core.add_request("other", OTHER, GREEDY)
    plan = start_load(core, EngineRequest("r", PROMPT, GREEDY), num_stored_blocks=4)
    assert (plan.first_block, len(plan.block_ids)) == (0, 4)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # the load is in flight: "other" steps, "r" waits
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert "r" not in tokens and tokens["other"]
    assert (engine_stats(core).num_running, engine_stats(core).num_waiting) == (1, 1)  # loading counts as waiting
    assert finish_load(core, plan, payloads)
    outputs = run(core, tokens)
    assert outputs["r"] == reference
    assert core.scheduler.block_pool.num_free_blocks == core.kv_plan.num_blocks - 1


def test_cached_tokens_report_the_store_tier(tiny_dir, stored):
    reference, hashes, payloads = stored
    core = engine(tiny_dir)
    core.add_request("warm", PROMPT[:5], GREEDY.clone(max_tokens=1))  # the first block is on the device
    run(core)
    plan = start_load(core, EngineRequest("r", PROMPT, GREEDY), num_stored_blocks=4)
    assert (plan.first_block, len(plan.block_ids)) == (1, 3)
    assert finish_load(core, plan, payloads[1:])
    first = core.step()[0]
    assert (first.num_cached_tokens, first.num_store_cached_tokens) == (16, 12)
    assert first.new_token_ids + run(core)["r"] == reference


def test_payloads_that_do_not_fit_or_a_failed_load_recompute(tiny_dir, stored):
    reference, hashes, payloads = stored
    core = engine(tiny_dir)
    plan = start_load(core, EngineRequest("r", PROMPT, GREEDY), num_stored_blocks=4)
    assert not finish_load(core, plan, [p[:-4] for p in payloads])  # truncated: refused, never imported
    assert run(core)["r"] == reference
    plan = start_load(core, EngineRequest("s", PROMPT, GREEDY.clone(max_tokens=2)), num_stored_blocks=4)
    assert plan is None  # the device holds the prefix now: queued to compute, nothing to load
    assert run(core)["s"] == reference[:2]

    fresh = engine(tiny_dir)
    plan = start_load(fresh, EngineRequest("t", PROMPT, GREEDY), num_stored_blocks=4)
    fail_load(fresh, "t")
    first = fresh.step()[0]
    assert (first.num_cached_tokens, first.num_store_cached_tokens) == (0, 0)
    assert first.new_token_ids + run(fresh)["t"] == reference


def _staged_chunks(core, payloads, chunk_blocks):
    """A StagingPool for this engine's caches, and per chunk (first, rows) holding `payloads`."""
    from deepinfer.engine.kv_transfer import StagingPool, block_nbytes

    pool = StagingPool(block_nbytes(core.runner.kv_caches), chunk_blocks, num_chunks=2, pin=False)
    chunks = []
    for first in range(0, len(payloads), chunk_blocks):
        chunk = asyncio.run(pool.acquire())
        part = payloads[first : first + chunk_blocks]
        for view, payload in zip(chunk.views, part, strict=False):
            view[:] = payload
        chunks.append((first, chunk.rows[: len(part)]))
    return pool, chunks


def test_a_prefix_imported_chunk_by_chunk_gives_the_recomputed_tokens(tiny_dir, stored):
    from deepinfer.engine.kv_load import complete_load, import_chunk

    reference, hashes, payloads = stored
    core = engine(tiny_dir)
    core.add_request("other", OTHER, GREEDY)
    plan = start_load(core, EngineRequest("r", PROMPT, GREEDY), num_stored_blocks=4)
    pool, chunks = _staged_chunks(core, payloads, chunk_blocks=3)  # chunks of 3 and 1 blocks
    tokens: dict[str, list[int]] = {}
    for first, rows in chunks:  # steps between the chunks: the loading request is not scheduled, its blocks unseen
        assert import_chunk(core, plan, first, rows, pool) == (True, None)
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert "r" not in tokens
        assert core.scheduler.block_pool.get_cached_block(hashes[0]) is None  # cached only by complete_load
    assert complete_load(core, plan)
    first = core.step()
    assert [o.num_store_cached_tokens for o in first if o.request_id == "r"] == [16]
    for out in first:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert run(core, tokens)["r"] == reference


def test_an_aborted_load_writes_no_later_chunk(tiny_dir, stored):
    from deepinfer.engine.kv_load import complete_load, import_chunk

    reference, hashes, payloads = stored
    core = engine(tiny_dir)
    plan = start_load(core, EngineRequest("r", PROMPT, GREEDY), num_stored_blocks=4)
    pool, chunks = _staged_chunks(core, payloads, chunk_blocks=2)
    assert import_chunk(core, plan, *chunks[0], pool)[0]
    core.abort_requests(["r"])  # its blocks are free again: another request may own them now
    before = [kv.clone() for kv in core.runner.kv_caches]
    assert import_chunk(core, plan, *chunks[1], pool) == (False, None)
    assert all(torch.equal(a, b) for a, b in zip(before, core.runner.kv_caches, strict=True))
    assert not complete_load(core, plan)
    assert core.scheduler.block_pool.num_free_blocks == core.kv_plan.num_blocks - 1
