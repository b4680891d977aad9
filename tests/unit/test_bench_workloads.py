"""deepinfer.bench's workloads without I/O: Poisson and trace arrival schedules, trace prompts whose shared hash
ids give shared prefixes, conversation turns that resend the history, plans dealt to several processes, and the
generator's report of its own lags."""

import argparse
import io
import math
import statistics

import pytest

from deepinfer.bench.arrivals import poisson_offsets, trace_offsets
from deepinfer.bench.cli import add_arguments
from deepinfer.bench.compare import figures, point_name
from deepinfer.bench.generator import Outcome, Progress, Share, generator_report
from deepinfer.bench.load import ClosedLoop, Conversations, OpenLoop
from deepinfer.bench.metrics import RequestRecord, per_turn
from deepinfer.bench.prompts import first_turn, next_turn, trace_prompt, user_message
from deepinfer.bench.workloads import sweep


def test_poisson_arrivals_are_seeded_increasing_and_have_the_rate_asked():
    offsets = poisson_offsets(4.0, 4000, seed=7)
    assert offsets == poisson_offsets(4.0, 4000, seed=7) and offsets != poisson_offsets(4.0, 4000, seed=8)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    assert min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)  # mean gap 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: stdev = mean
    with pytest.raises(ValueError, match="positive"):
        poisson_offsets(0, 3)


def test_trace_offsets_start_at_the_first_line_and_scale():
    assert trace_offsets([1000, 1500, 4000]) == [0.0, 0.5, 3.0]
    assert trace_offsets([1000, 1500, 4000], time_scale=0.5) == [0.0, 0.25, 1.5]
    assert trace_offsets([]) == []


def test_shared_hash_ids_give_shared_prefixes_and_the_length_asked():
    # block_size 4: hash ids [1, 2, 3] and [1, 2, 9] share their first 8 words, not the 9th
    a = trace_prompt([1, 2, 3], input_length=10, block_size=4).split(" ")
    b = trace_prompt([1, 2, 9], input_length=12, block_size=4).split(" ")
    c = trace_prompt([5, 2, 3], input_length=12, block_size=4).split(" ")
    assert len(a) == 10 and len(b) == 12
    assert a[:8] == b[:8] and a[8:10] != b[8:10]
    assert a == trace_prompt([1, 2, 3], input_length=10, block_size=4).split(" ")  # deterministic
    assert a[:4] != c[:4]  # a different first hash id shares nothing
    # a block's text depends on its hash id only: the last (partial) block is a prefix of the whole one
    assert trace_prompt([3], 2, 4).split(" ") == trace_prompt([3], 4, 4).split(" ")[:2]


def test_a_line_longer_than_its_hash_ids_ends_in_words_of_its_own():
    one = trace_prompt([1], input_length=8, block_size=4, line=0).split(" ")
    two = trace_prompt([1], input_length=8, block_size=4, line=1).split(" ")
    assert len(one) == 8 and one[:4] == two[:4] and one[4:] != two[4:]


def test_every_turn_resends_the_history_and_the_answer():
    first = first_turn(user_message(0, conversation=0, turn=0, num_words=5))
    second = next_turn(first, " an answer", user_message(0, 0, 1, 5))
    assert second.startswith(first + " an answer\n") and second.endswith("Assistant:")
    assert user_message(0, 0, 1, 5) in second and user_message(0, 0, 1, 5) != user_message(0, 1, 1, 5)


def test_plans_deal_their_requests_to_processes():
    bodies = tuple({"prompt": str(i)} for i in range(5))
    closed = ClosedLoop(bodies, concurrency=3).split(2)
    assert [(len(p.bodies), p.concurrency) for p in closed] == [(3, 2), (2, 1)]
    assert sorted(b["prompt"] for p in closed for b in p.bodies) == [str(i) for i in range(5)]
    assert [p.concurrency for p in ClosedLoop(bodies, concurrency=1).split(2)] == [
        1
    ]  # no share without a client
    opened = OpenLoop(bodies, (0.0, 0.1, 0.2, 0.3, 0.4)).split(2)
    assert [p.offsets_s for p in opened] == [(0.0, 0.2, 0.4), (0.1, 0.3)]
    talks = Conversations("m", (("a", "b"), ("c", "d"), ("e", "f")), max_tokens=4).split(2)
    assert [p.messages for p in talks] == [(("a", "b"), ("e", "f")), (("c", "d"),)]
    assert sum(p.num_requests for p in talks) == 6


def test_cached_tokens_are_reported_turn_by_turn():
    records = [
        RequestRecord(0.0, chunk_s=[0.1], end_s=0.2, prompt_tokens=10, turn=0),
        RequestRecord(0.0, chunk_s=[0.1], end_s=0.2, prompt_tokens=10, turn=0),
        RequestRecord(0.3, chunk_s=[0.35], end_s=0.4, prompt_tokens=30, cached_tokens=16, turn=1),
        RequestRecord(0.3, end_s=0.4, error="HTTP 500", turn=1),
    ]
    turns = per_turn(records)
    assert [(t["turn"], t["num_requests"], t["prompt_tokens"], t["cached_tokens"]) for t in turns] == [
        (0, 2, 20, 0),
        (1, 1, 30, 16),
    ]
    assert turns[0]["cached_fraction"] == 0.0 and turns[1]["cached_fraction"] == pytest.approx(
        16 / 30, abs=1e-4
    )
    assert turns[1]["ttft_ms"]["p50"] == pytest.approx(50.0)
    assert math.isnan(per_turn([RequestRecord(0.0, end_s=1.0, error="x", turn=0)])[0]["cached_fraction"])


def test_compare_names_every_workload_s_points():
    assert [
        point_name(p) for p in ({"concurrency": 4}, {"rate": 0.5}, {"time_scale": 2.0}, {"conversations": 3})
    ] == ["c=4", "rate=0.5", "x=2", "conv=3"]
    result = {
        "points": [{"rate": 4.0, "ttft_ms": {"p99": 12.0}, "turns": [{"turn": 1, "ttft_ms": {"p50": 3.0}}]}]
    }
    assert dict(figures(result)) == {
        "points.rate=4.rate": 4.0,
        "points.rate=4.ttft_ms.p99": 12.0,
        "points.rate=4.turns.turn=1.turn": 1.0,
        "points.rate=4.turns.turn=1.ttft_ms.p50": 3.0,
    }


def test_the_generator_says_when_it_was_the_bottleneck():
    on_time = [RequestRecord(sent_s=1.0 + i, scheduled_s=1.0 + i, end_s=2.0 + i) for i in range(10)]
    calm = generator_report(
        Outcome(on_time, 10.0, [Share(on_time, cpu_s=1.0, wall_s=10.0, loop_lag_s=[0.001] * 9)])
    )
    assert (
        calm["processes"] == 1 and calm["cpu_share"] == 0.1 and not calm["bottleneck"] and not calm["reasons"]
    )
    assert calm["send_lag_ms"]["p99"] == 0.0 and calm["loop_lag_ms"]["p50"] == pytest.approx(1.0)
    late = [RequestRecord(sent_s=1.0 + i + 0.05 * i, scheduled_s=1.0 + i, end_s=3.0 + i) for i in range(10)]
    busy = Share(late[:5], cpu_s=9.5, wall_s=10.0)
    worst = generator_report(Outcome(late, 12.0, [busy, Share(late[5:], cpu_s=1.0, wall_s=10.0)]))
    assert worst["processes"] == 2 and worst["cpu_share"] == 0.95 and worst["bottleneck"]
    assert worst["send_lag_ms"]["max"] == pytest.approx(450.0)
    assert [r.split(" ")[0] for r in worst["reasons"]] == ["a", "send"]  # CPU share, then send lag
    closed = generator_report(
        Outcome([RequestRecord(sent_s=0.0, end_s=1.0)], 1.0, [Share([], cpu_s=0.1, wall_s=1.0)])
    )
    assert "send_lag_ms" not in closed  # no schedule in a closed loop


def test_progress_is_one_line_per_update_off_a_terminal():
    stream = io.StringIO()
    progress = Progress("rate=4", total=3, stream=stream)
    progress.count(RequestRecord(0.0))
    progress.count(RequestRecord(0.0, error="HTTP 500"))
    progress.finish()
    assert (
        stream.getvalue().startswith("[rate=4] 2/3 requests, 1 failed, ")
        and stream.getvalue().count("\n") == 1
    )


def _sweep(flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["run", *flags.split()])
    return sweep(args, "m")


def test_every_point_draws_its_own_prompts_the_same_on_every_run():
    name, points = _sweep("--concurrency 1,4 --num-prompts 3 --input-words 5")
    assert name == "concurrency" and [(label, plan.concurrency) for label, plan in points] == [
        ({"concurrency": 1}, 1),
        ({"concurrency": 4}, 4),
    ]
    first, second = ([body["prompt"] for body in plan.bodies] for _, plan in points)
    assert len(first) == 3 and not set(first) & set(second)  # c=4 does not find c=1's prompts cached
    again = _sweep("--concurrency 1,4 --num-prompts 3 --input-words 5")[1][0][1]
    assert first == [body["prompt"] for body in again.bodies]
    # a salt gives a trace other text for the same hash ids, shared as before within it
    assert trace_prompt([1, 2], 8, 4, salt="0:1") != trace_prompt([1, 2], 8, 4, salt="0:0")
    assert trace_prompt([1, 2], 8, 4, salt="0:1")[:10] == trace_prompt([1, 3], 8, 4, salt="0:1")[:10]


def test_a_rate_sweep_and_conversations_from_their_flags():
    name, points = _sweep("--rate 2,8 --num-prompts 4 --max-tokens 3 --ignore-eos --seed 5")
    assert name == "rate" and [label for label, _ in points] == [{"rate": 2.0}, {"rate": 8.0}]
    plan = points[1][1]
    assert plan.offsets_s == tuple(poisson_offsets(8.0, 4, seed=5))
    assert plan.bodies[0]["max_tokens"] == 3 and plan.bodies[0]["ignore_eos"] is True
    name, points = _sweep("--conversations 2 --turns 3 --input-words 4")
    ((label, talk),) = points
    assert name == "multiturn" and label == {"conversations": 2} and talk.num_requests == 6
    with pytest.raises(ValueError, match="--rate takes positive numbers"):
        _sweep("--rate 0,4")
    with pytest.raises(ValueError, match="--processes takes a positive integer"):
        _sweep("--processes 0")
