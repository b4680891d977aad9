"""bench/host_overhead.py: the async mode drives EngineCore.step through the CUDA-graph runner's host path on the CPU."""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_overhead  # noqa: E402
import pytest  # noqa: E402

from deepinfer.protocol import FinishReason  # noqa: E402


@pytest.mark.parametrize("graph_sampling", [True, False])
def test_async_engine_runs_every_decode_step_through_the_graph_runner(graph_sampling):
    core = host_overhead.build_async_engine(batch=4, context=40, block_size=16, max_tokens=6,
                                            graph_sampling=graph_sampling)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    for _ in range(20):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        if not core.has_unfinished_requests() and core._in_flight is None:
            break
    assert sorted(tokens) == [f"r{i}" for i in range(4)]
    assert all(len(t) == 6 for t in tokens.values())
    assert set(finish.values()) == {FinishReason.LENGTH}
    # Every step was decode-only: all went through CudaGraphRunner.run (GraphInputs.fill, placeholder fill).
    assert core.runner.graphs.num_replays >= 6
    assert not core.scheduler.requests and core.scheduler.block_pool.num_free_blocks > 0


def test_measure_async_reports_the_phases_and_unwraps_what_it_timed():
    try:
        res = host_overhead.measure_async(batch=4, context=40, steps=4, graph_sampling=False)
    finally:
        gc.unfreeze()  # the bench freezes what exists, as the worker does; not in the test process
    # sampling is part of the step; not "> 0" without it: a median step less the mean sampling phases, which one
    # preempted step on a busy machine can make negative
    assert res["mode"] == "async" and res["step_ms"] > 0 and res["step_ms"] > res["step_ms_without_sampling"]
    phases = res["phases_ms"]
    for name in ("schedule", "update", "prepare", "graph_run", "graph_fill", "sampling_metadata", "sampler",
                 "finish_in_flight", "host_tier_offload"):
        assert phases[name] > 0, name


def test_greedy_steps_take_the_graphs_tokens_without_metadata_or_sampler():
    # graph_sampling: every request is greedy (temperature 0, no penalties), so no step builds sampling metadata
    # or runs the sampler: the tokens are the graph tail's argmax.
    try:
        res = host_overhead.measure_async(batch=4, context=40, steps=4, graph_sampling=True)
    finally:
        gc.unfreeze()
    phases = res["phases_ms"]
    assert phases["sampling_metadata"] == 0 and phases["sampler"] == 0
    assert phases["graph_run"] > 0 and res["step_ms"] == res["step_ms_without_sampling"] > 0


@pytest.mark.parametrize("graph_sampling", [True, False])
def test_graph_path_feeds_each_request_the_token_its_previous_step_sampled(graph_sampling):
    # The fake model's logits ignore the inputs, so check the inputs themselves: the ids in the static input
    # buffer at each replay are the prompt's last token, then every token the request was given, in order.
    core = host_overhead.build_async_engine(batch=8, context=40, block_size=16, max_tokens=12,
                                            graph_sampling=graph_sampling)
    graphs, fed = core.runner.graphs, {}
    run = graphs.run

    def recording_run(batch, block_table, *args):
        hidden = run(batch, block_table, *args)
        for s, token_id in zip(batch.sampled, graphs.static64[0, : batch.num_seqs].tolist(), strict=True):
            fed.setdefault(s.request_id, []).append(token_id)
        return hidden

    graphs.run = recording_run
    tokens: dict[str, list[int]] = {}
    for _ in range(40):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not core.has_unfinished_requests() and core._in_flight is None:
            break
    assert sorted(tokens) == sorted(fed) and len(tokens) == 8
    for request_id, sampled in tokens.items():
        assert len(sampled) == 12
        assert fed[request_id][1:] == sampled[: len(fed[request_id]) - 1], request_id
    assert len({tuple(t) for t in tokens.values()}) > 1  # the tokens differ between requests
