"""The Mooncake trace format, the synthetic multi-turn generator and the ideal single-cache hit count."""

from __future__ import annotations

from deepinfer.testing.trace_replay import Outcome, summarize
from deepinfer.testing.traces import (
    TraceRequest,
    ideal_cached_tokens,
    multi_turn_trace,
    read_trace,
    trace_tokens,
    write_trace,
)

SESSION_ORDER = [1, 1, 5, 5, 5, 1]  # seeded: interleaved, each session's turns in order


def test_multi_turn_sessions_extend_their_previous_turn_in_a_seeded_interleaving(tmp_path):
    trace = multi_turn_trace(2, 3, block_size=4, first_blocks=2, blocks_per_turn=1, shared_blocks=1, seed=3)
    assert trace == multi_turn_trace(2, 3, block_size=4, first_blocks=2, blocks_per_turn=1, shared_blocks=1, seed=3)
    by_session = {}
    for request in trace:
        by_session.setdefault(request.hash_ids[1], []).append(request.hash_ids)
    assert by_session == {1: [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]], 5: [[0, 5, 6], [0, 5, 6, 7], [0, 5, 6, 7, 8]]}
    assert [r.hash_ids[1] for r in trace] == SESSION_ORDER
    assert [r.timestamp for r in trace] == [0, 100, 200, 300, 400, 500]
    assert [r.input_length for r in trace] == [4 * len(r.hash_ids) for r in trace]
    write_trace(tmp_path / "t.jsonl", trace)
    assert read_trace(tmp_path / "t.jsonl") == trace


def test_ideal_reuses_whole_prefix_blocks_seen_before_never_the_last_token():
    trace = [
        TraceRequest(0, 12, 1, [1, 2, 3]),
        TraceRequest(1, 16, 1, [1, 2, 3, 4]),  # 3 blocks seen
        TraceRequest(2, 16, 1, [1, 2, 3, 4]),  # all seen: the last block is computed again
        TraceRequest(3, 10, 1, [9, 2, 3]),  # another first block: nothing reusable
        TraceRequest(4, 11, 1, [1, 2, 7]),  # partial last block
    ]
    assert ideal_cached_tokens(trace, 4) == [0, 12, 12, 0, 8]


def test_hash_ids_map_to_fixed_token_runs():
    a, b = TraceRequest(0, 8, 1, [5, 6]), TraceRequest(0, 6, 1, [5, 7])
    ta, tb = trace_tokens(a, 4, 50), trace_tokens(b, 4, 50)
    assert ta[:4] == tb[:4] and ta[4:] != tb[4:4] + tb[4:] and len(tb) == 6
    assert all(1 <= t < 50 for t in ta + tb)
    assert trace_tokens(a, 4, 50, salt=1) != ta


def test_summary_against_the_ideal():
    trace = [TraceRequest(0, 8, 2, [1, 2]), TraceRequest(1, 12, 2, [1, 2, 3])]
    outcomes = [Outcome(8, 0, 2, 0.1), Outcome(12, 4, 2, 0.3)]
    result = summarize("prefix", trace, outcomes, 4, wall_s=2.0)
    assert (result.cached_tokens, result.ideal_cached_tokens, result.prompt_tokens) == (4, 8, 20)
    assert (result.hit_fraction, result.ideal_fraction, result.of_ideal) == (0.2, 0.4, 0.5)
    assert result.output_tokens_per_s == 2.0 and result.ttft_p50_s == 0.2 and result.num_errors == 0
