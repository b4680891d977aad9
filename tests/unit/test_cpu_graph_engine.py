"""deepinfer.testing.cpu_graph_engine: async EngineCore.step through the CUDA-graph runner's host path on the CPU
(what bench/gpu/host_overhead.py times)."""

from collections import Counter

import pytest

from deepinfer.protocol import FinishReason
from deepinfer.testing.cpu_graph_engine import build_async_engine


@pytest.mark.parametrize("graph_sampling", [True, False])
def test_async_engine_runs_every_decode_step_through_the_graph_runner(graph_sampling):
    core = build_async_engine(batch=4, context=40, block_size=16, max_tokens=6,
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


def counted_steps(graph_sampling: bool, steps: int) -> Counter:
    """Calls of each part of the step over `steps` async decode steps (the parts host_overhead.py times)."""
    core = build_async_engine(batch=4, context=40, block_size=16, max_tokens=4 * steps, graph_sampling=graph_sampling)
    runner, calls = core.runner, Counter()
    parts = {"schedule": (core.scheduler, "schedule"), "update": (core.scheduler, "update_sampled"),
             "prepare": (runner, "prepare_batch"), "graph_run": (runner.graphs, "run"),
             "graph_fill": (runner.graphs.inputs, "fill"), "sampling_metadata": (runner.sampling_metadata, "build"),
             "sampler": (runner, "sampler"), "host_tier_offload": (core.host_tier, "offload")}
    for name, (owner, method) in parts.items():
        original = getattr(owner, method)

        def call(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(owner, method, call)  # an instance attribute shadows the class's method
    for _ in range(steps):
        core.step()
    return calls


def test_each_async_step_runs_every_part_the_bench_times():
    calls = counted_steps(graph_sampling=False, steps=4)
    for name in ("schedule", "update", "prepare", "graph_run", "graph_fill", "sampling_metadata", "sampler",
                 "host_tier_offload"):
        assert calls[name] >= 3, (name, calls)


def test_greedy_steps_take_the_graphs_tokens_without_metadata_or_sampler():
    # graph_sampling: every request is greedy (temperature 0, no penalties), so no step builds sampling metadata
    # or runs the sampler: the tokens are the graph tail's argmax.
    calls = counted_steps(graph_sampling=True, steps=4)
    assert calls["sampling_metadata"] == 0 and calls["sampler"] == 0
    assert calls["graph_run"] >= 3


@pytest.mark.parametrize("graph_sampling", [True, False])
def test_graph_path_feeds_each_request_the_token_its_previous_step_sampled(graph_sampling):
    # The fake model's logits ignore the inputs, so check the inputs themselves: the ids in the static input
    # buffer at each replay are the prompt's last token, then every token the request was given, in order.
    core = build_async_engine(batch=8, context=40, block_size=16, max_tokens=12,
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
