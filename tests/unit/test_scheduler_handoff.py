"""Disaggregation support in the scheduler: prefill leases (held blocks) and admitting pre-filled requests."""

from __future__ import annotations

from types import SimpleNamespace

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler


def params(max_tokens=4):
    return SimpleNamespace(max_tokens=max_tokens, min_tokens=0, ignore_eos=True, stop_token_ids=[])


def make_scheduler(num_blocks=16, caching=True):
    return Scheduler(EngineConfig(num_blocks=num_blocks, max_model_len=40, block_size=4,
                                  enable_prefix_caching=caching))


def run_to_finish(scheduler, token=7):
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, {s.request_id: [token] for s in out.scheduled if s.sample})


def test_held_blocks_stay_referenced_until_release():
    scheduler = make_scheduler()
    request = Request("p", list(range(10)), params(max_tokens=1))
    request.hold_blocks = True
    scheduler.add_request(request)
    run_to_finish(scheduler)
    held = scheduler.held_block_ids("p")
    assert held == [1, 2, 3]  # 10 prompt tokens in blocks of 4; block 0 is the padding block
    assert all(scheduler.block_pool.blocks[b].ref_cnt == 1 for b in held)
    assert scheduler.num_held == 1
    assert scheduler.release_held("p")
    assert all(scheduler.block_pool.blocks[b].ref_cnt == 0 for b in held)
    assert not scheduler.release_held("p")
    assert scheduler.num_held == 0


def test_aborted_request_does_not_hold():
    scheduler = make_scheduler()
    request = Request("p", list(range(10)), params())
    request.hold_blocks = True
    scheduler.add_request(request)
    scheduler.schedule()
    scheduler.abort_requests(["p"])
    assert scheduler.held_block_ids("p") is None
    assert scheduler.block_pool.num_free_blocks == 15


def test_prefilled_request_gets_blocks_then_decodes():
    scheduler = make_scheduler()
    request = Request("d", list(range(10)), params(max_tokens=3))
    request.append_output_token_ids([42])  # the prefill worker's first token
    to_fill = scheduler.add_prefilled_request(request, 10)
    assert to_fill == [1, 2, 3]
    scheduler.commit_prefilled("d")
    out = scheduler.schedule()
    (only,) = out.scheduled
    # The first token's KV is computed by the first decode step, at position 10.
    assert (only.token_ids, only.num_computed_tokens, only.num_new_tokens, only.sample) == ([42], 10, 1, True)
    updates = scheduler.update(out, {"d": [5]})
    assert updates[0].new_token_ids == [5]
    run_to_finish(scheduler)
    assert request.output_token_ids == [42, 5, 7]


def test_prefilled_request_reuses_local_prefix_hits():
    scheduler = make_scheduler()
    first = Request("a", list(range(10)), params(max_tokens=1))
    scheduler.add_request(first)
    run_to_finish(scheduler)
    second = Request("b", list(range(10)), params())
    second.append_output_token_ids([42])
    to_fill = scheduler.add_prefilled_request(second, 10)
    # Blocks 1 and 2 (tokens 0..7) are cached locally; only the tail block is filled from the pull.
    assert scheduler.kv_manager.get_block_ids(second)[:2] == [1, 2]
    assert len(to_fill) == 1 and to_fill[0] not in (1, 2)
    assert second.num_cached_tokens == 8


def test_prefilled_request_without_room_is_refused():
    scheduler = make_scheduler(num_blocks=11, caching=False)
    request = Request("d", list(range(39)), params())
    request.append_output_token_ids([1])
    assert scheduler.add_prefilled_request(request, 39) is not None
    other = Request("e", list(range(20)), params())
    other.append_output_token_ids([1])
    assert scheduler.add_prefilled_request(other, 20) is None
    assert "e" not in scheduler.requests


def test_resumed_request_with_output_tokens_recomputes_them():
    scheduler = make_scheduler()
    request = Request("r", list(range(6)), params(max_tokens=3))
    request.append_output_token_ids([42])
    scheduler.add_request(request)
    out = scheduler.schedule()
    (only,) = out.scheduled
    assert only.token_ids == [0, 1, 2, 3, 4, 5, 42] and only.sample
