"""Continuous-batching scheduler driven by a fake runner that keeps a paged 'KV cache' of token ids.

The fake runner writes each step's input token ids into the slots its block table names and samples the next
token from the context it reads back through the block table, so a wrong block table, a bad prefix hit or a
block overwritten while shared changes the generated tokens, which are checked against a plain reference.
Like the real runner, it keeps each request's block table from the new block ids the scheduler sends (the whole
table when is_new) and drops it when the request is reported finished or preempted.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest

from deepinfer.engine.block_pool import Removed, Stored
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.hashing import hash_blocks
from deepinfer.protocol import FinishReason


@dataclass
class Params:
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of every token of the context (never 0..9)."""
    return sum((i + 1) * t for i, t in enumerate(context)) % 1000 + 10


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes token ids into paged slots and samples from what it reads back through the block table."""

    def __init__(self, config: EngineConfig, script: dict[str, list[int]] | None = None) -> None:
        self.block_size = config.block_size
        self.slots: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_blocks)]
        self.script = script or {}
        self.steps: list[SchedulerOutput] = []
        self.tables: dict[str, list[int]] = {}
        #: Whole block table of each scheduled request, per executed step.
        self.tables_at: list[dict[str, list[int]]] = []

    def apply_block_ids(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self.tables.pop(request_id, None)
        for sched in output.scheduled:
            if sched.is_new:
                self.tables[sched.request_id] = list(sched.new_block_ids)
            else:
                self.tables[sched.request_id].extend(sched.new_block_ids)
        self.tables_at.append({s.request_id: list(self.tables[s.request_id]) for s in output.scheduled})

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        self.steps.append(output)
        self.apply_block_ids(output)
        written: dict[int, str] = {}
        for sched in output.scheduled:
            assert len(sched.token_ids) == sched.num_new_tokens > 0
            table = self.tables[sched.request_id]
            assert len(table) == -(-(sched.num_computed_tokens + sched.num_new_tokens) // self.block_size)
            for i, token_id in enumerate(sched.token_ids):
                pos = sched.num_computed_tokens + i
                block_id = table[pos // self.block_size]
                assert block_id != 0, "block 0 is padding"
                self.slots[block_id][pos % self.block_size] = token_id
                written[block_id] = sched.request_id
        for sched in output.scheduled:  # no block written this step is read by another request
            assert all(written.get(b, sched.request_id) == sched.request_id for b in self.tables[sched.request_id])
        sampled = {}
        for sched in output.scheduled:
            if not sched.sample:
                continue
            script = self.script.get(sched.request_id)
            if script is not None:
                sampled[sched.request_id] = [script.pop(0)]
                continue
            end = sched.num_computed_tokens + sched.num_new_tokens
            table = self.tables[sched.request_id]
            context = [self.slots[table[p // self.block_size]][p % self.block_size] for p in range(end)]
            sampled[sched.request_id] = [next_token(context)]
        return sampled


def make_config(**overrides) -> EngineConfig:
    values = dict(
        num_blocks=12, max_model_len=32, block_size=4, max_num_batched_tokens=64, model_fingerprint=b"fp"
    )
    values.update(overrides)
    return EngineConfig(**values)


def make_request(request_id: str, prompt: list[int], arrival_time: float, **params) -> Request:
    eos = params.pop("eos_token_ids", ())
    return Request(request_id, prompt, Params(**params), eos_token_ids=eos, arrival_time=arrival_time)


def check_invariants(scheduler: Scheduler) -> None:
    pool = scheduler.block_pool
    holders = [0] * pool.num_blocks
    for request in scheduler.requests.values():
        for block_id in scheduler.kv_manager.get_block_ids(request):
            holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    free_ids = pool.free_block_queue.block_ids()
    assert sorted(free_ids) == [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0]
    assert all(block.block_hash == h for h, block in pool.cached_block_hash_to_block.items())


def run_step(scheduler: Scheduler, runner: FakeRunner):
    output = scheduler.schedule()
    updates = scheduler.update(output, runner.execute(output))
    check_invariants(scheduler)
    return output, updates


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 200) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, updates = run_step(scheduler, runner)
        for update in updates:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    raise AssertionError("did not finish")


def test_first_step_allocates_fresh_blocks_in_order():
    scheduler, prompt = Scheduler(make_config()), list(range(100, 110))
    scheduler.add_request(make_request("a", prompt, 0.0))
    (sched,) = scheduler.schedule().scheduled
    assert (sched.request_id, sched.new_block_ids, sched.is_new) == ("a", [1, 2, 3], True)
    assert (sched.num_computed_tokens, sched.num_new_tokens) == (0, 10)
    assert sched.token_ids == prompt and sched.sample and sched.is_new


def test_prefix_hit_on_second_request_shares_blocks():
    config = make_config(num_blocks=20)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("a", prompt, 0.0))
    run_step(scheduler, runner)
    assert scheduler.take_kv_events() == [Stored(hash_blocks(prompt, 4, b"fp", ""), None)]
    scheduler.add_request(make_request("b", prompt, 1.0))
    output, updates = run_step(scheduler, runner)
    sched_a, sched_b = output.scheduled
    assert (sched_a.request_id, sched_a.num_new_tokens, runner.tables["a"]) == ("a", 1, [1, 2, 3])
    assert (sched_a.is_new, sched_a.new_block_ids) == (False, [])  # a decode within its third block
    assert (sched_b.new_block_ids, sched_b.num_computed_tokens, sched_b.token_ids) == ([1, 2, 4], 8, prompt[8:])
    assert [scheduler.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert scheduler.requests["b"].num_cached_tokens == 8
    (update_b,) = [u for u in updates if u.request_id == "b"]
    assert update_b.num_cached_tokens == 8
    first_b = update_b.new_token_ids
    assert first_b + run_to_completion(scheduler, runner)["b"] == reference_output(prompt, 16)
    assert scheduler.block_pool.num_free_blocks == config.num_blocks - 1


def test_full_prompt_in_cache_still_computes_its_last_token():
    config = make_config()
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(100, 108))  # exactly 2 blocks
    scheduler.add_request(make_request("a", prompt, 0.0, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, 1.0, max_tokens=1))
    (sched,) = scheduler.schedule().scheduled
    assert (sched.num_computed_tokens, sched.num_new_tokens, sched.new_block_ids[0]) == (4, 4, 1)
    assert scheduler.requests["b"].num_cached_tokens == 4


def test_outputs_match_the_reference_with_prefix_hits():
    config = make_config(num_blocks=40, max_model_len=40)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    shared = list(range(200, 213))
    scheduler.add_request(make_request("a", shared + [1, 2], 0.0, max_tokens=9))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", shared + [3], 1.0, max_tokens=9))
    scheduler.add_request(make_request("c", shared, 2.0, max_tokens=9))
    outputs = run_to_completion(scheduler, runner)
    assert scheduler.block_pool.num_free_blocks == 39
    assert outputs["b"] == reference_output(shared + [3], 9)
    assert outputs["c"] == reference_output(shared, 9)
    assert len(outputs["a"]) == 8  # its first token came from the first step, outside run_to_completion


def test_preemption_by_recompute():
    # 5 usable blocks of 4 tokens; two 7-token prompts take 2 blocks each; the 9th token of each needs a 3rd
    config = make_config(num_blocks=6, max_model_len=20)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt_a, prompt_b = list(range(100, 107)), list(range(300, 307))
    scheduler.add_request(make_request("a", prompt_a, 0.0, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_b, 1.0, max_tokens=10))
    req_b = scheduler.requests["b"]
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    steps, events = [None], [None]  # 1-based step numbers
    while scheduler.has_unfinished_requests():
        output, updates = run_step(scheduler, runner)
        steps.append(output)
        events.append(scheduler.take_kv_events())
        for u in updates:
            outputs[u.request_id].extend(u.new_token_ids)
        if len(steps) - 1 == 3:
            assert req_b.status is RequestStatus.PREEMPTED
            assert (req_b.num_computed_tokens, req_b.num_output_tokens) == (0, 2)
            assert list(scheduler.waiting) == [req_b] and scheduler.kv_manager.get_block_ids(req_b) == []
            assert scheduler.block_pool.free_block_queue.block_ids() == [4, 3]  # b's tail block first

    tables_at = [None, *runner.tables_at]  # 1-based, as steps
    assert [[(s.request_id, tables_at[i][s.request_id]) for s in steps[i].scheduled] for i in (2, 3)] == [
        [("a", [1, 2]), ("b", [3, 4])],
        [("a", [1, 2, 5])],
    ]
    assert [s.new_block_ids for s in steps[3].scheduled] == [[5]]  # only the block appended since step 2
    assert steps[3].preempted_request_ids == ["b"]  # the most recent arrival, here the request asking
    assert not any(steps[i].preempted_request_ids for i in range(4, len(steps)))
    # a's 13th token (step 7) needs a 4th block: b's tail block, cached and least recently freed, is evicted
    assert tables_at[7]["a"] == [1, 2, 5, 4] and steps[7].scheduled[0].new_block_ids == [4]
    assert events[7] == [Removed([req_b.block_hashes[1]])]
    # a finishes in step 10; b resumes in step 11: its head block is still cached, the rest is recomputed
    assert steps[11].finished_request_ids == ["a"]
    (resumed,) = steps[11].scheduled
    assert (resumed.request_id, resumed.is_new, resumed.new_block_ids) == ("b", True, [3, 4, 5])
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (4, 5)
    assert resumed.token_ids == prompt_b[4:] + outputs["b"][:2]
    assert req_b.num_cached_tokens == 0 and req_b.num_preemptions == 1  # cached tokens: the first admission's
    assert outputs == {"a": reference_output(prompt_a, 10), "b": reference_output(prompt_b, 10)}
    assert scheduler.block_pool.num_free_blocks == 5


def test_preempted_request_goes_to_the_front_of_the_waiting_queue():
    config = make_config(num_blocks=6, max_model_len=20, max_num_seqs=2)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompts = {"a": list(range(100, 107)), "b": list(range(300, 307)), "c": [7, 8, 9]}
    for i, (rid, prompt) in enumerate(prompts.items()):
        scheduler.add_request(make_request(rid, prompt, float(i), max_tokens=6))
    for _ in range(3):
        run_step(scheduler, runner)
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # b was preempted in step 3
    admitted = []
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        output, updates = run_step(scheduler, runner)
        admitted += [s.request_id for s in output.scheduled if s.is_new]
        for u in updates:
            outputs.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert admitted == ["b", "c"]
    assert outputs["c"] == reference_output(prompts["c"], 6)


def test_chunked_prefill_with_a_small_budget():
    config = make_config(max_num_batched_tokens=8)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(100, 120))
    scheduler.add_request(make_request("a", prompt, 0.0, max_tokens=2))
    chunks = []
    for _ in range(3):
        output, updates = run_step(scheduler, runner)
        (sched,) = output.scheduled
        chunks.append(
            (sched.num_computed_tokens, sched.num_new_tokens, sched.sample, sched.is_new, len(updates))
        )
    assert chunks == [(0, 8, False, True, 0), (8, 8, False, False, 0), (16, 4, True, False, 1)]
    assert output.scheduled[0].token_ids == prompt[16:]
    assert run_to_completion(scheduler, runner) == {"a": reference_output(prompt, 2)[1:]}


def test_long_prefill_threshold_caps_chunks():
    config = make_config(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add_request(make_request("a", list(range(100, 116)), 0.0, max_tokens=1))
    sizes = [run_step(scheduler, runner)[0].scheduled[0].num_new_tokens for _ in range(3)]
    assert sizes == [6, 6, 4]


def test_decodes_go_before_prefills_in_the_budget():
    config = make_config(max_num_batched_tokens=8, long_prefill_token_threshold=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add_request(make_request("long", list(range(100, 130)), 0.0))
    scheduler.add_request(make_request("short", [1, 2, 3], 1.0))
    output, _ = run_step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("long", 4), ("short", 3)]
    output, _ = run_step(scheduler, runner)
    # "short" decodes first although "long" (still prefilling) arrived first
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("short", 1), ("long", 4)]
    scheduler.add_request(make_request("new", [4, 5, 6, 7, 8], 2.0))
    output, _ = run_step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("short", 1),
        ("long", 4),
        ("new", 3),
    ]
    assert output.num_batched_tokens == 8


def test_max_prefill_tokens_bounds_every_prompt_chunk_of_a_step_but_no_decode():
    config = make_config(max_num_batched_tokens=64)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.max_prefill_tokens = 4  # what a ChunkTimer sets on the CPU
    scheduler.add_request(make_request("a", [1, 2, 3], 0.0, max_tokens=4))
    scheduler.add_request(make_request("b", list(range(100, 110)), 1.0, max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 3), ("b", 1)]
    scheduler.add_request(make_request("c", [4, 5, 6, 7, 8], 2.0, max_tokens=1))
    output, _ = run_step(scheduler, runner)  # a decodes outside the bound; b's chunk takes it whole, c waits
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 4)]
    scheduler.max_prefill_tokens = 8
    output, _ = run_step(scheduler, runner)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 1), ("b", 5), ("c", 3)]


def test_max_num_seqs():
    config = make_config(max_num_seqs=2)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i, rid in enumerate("abc"):
        scheduler.add_request(make_request(rid, [i + 1] * 3, float(i), max_tokens=2 + i))
    output, _ = run_step(scheduler, runner)
    assert [s.request_id for s in output.scheduled] == ["a", "b"] and scheduler.num_waiting == 1
    output, _ = run_step(scheduler, runner)  # a finishes here (2 tokens)
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    output, _ = run_step(scheduler, runner)
    assert [s.request_id for s in output.scheduled] == ["b", "c"] and output.finished_request_ids == ["a"]


def test_abort_drops_every_reference():
    config = make_config()
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("a", prompt, 0.0))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, 1.0))
    scheduler.add_request(make_request("waiting", [1] * 30, 2.0))
    scheduler.add_request(make_request("c", [1] * 30, 3.0))
    output = scheduler.schedule()
    aborted = scheduler.abort_requests(["a", "b", "waiting", "unknown"])
    assert [(r.request_id, r.finish_reason, r.status) for r in aborted] == [
        ("a", FinishReason.ABORT, RequestStatus.FINISHED_ABORTED),
        ("b", FinishReason.ABORT, RequestStatus.FINISHED_ABORTED),
        ("waiting", FinishReason.ABORT, RequestStatus.FINISHED_ABORTED),
    ]
    assert scheduler.update(output, runner.execute(output)) == []  # aborted between schedule and update
    scheduler.abort_requests(["c"])
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_pool.num_free_blocks == config.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in scheduler.block_pool.blocks)
    assert scheduler.schedule().finished_request_ids == ["a", "b", "waiting", "c"]

    scheduler.add_request(make_request("d", prompt, 4.0))
    (sched,) = scheduler.schedule().scheduled
    assert sched.new_block_ids[:2] == [1, 2] and scheduler.requests["d"].num_cached_tokens == 8


@pytest.mark.parametrize(
    ("params", "script", "expected_tokens", "reason", "stop_reason"),
    [
        (dict(eos_token_ids={2}), [5, 2, 7], [5, 2], FinishReason.STOP, None),
        (
            dict(eos_token_ids={2}, ignore_eos=True, max_tokens=3),
            [5, 2, 7],
            [5, 2, 7],
            FinishReason.LENGTH,
            None,
        ),
        (dict(eos_token_ids={2}, min_tokens=3), [2, 2, 2, 7], [2, 2, 2], FinishReason.STOP, None),
        (dict(stop_token_ids=(7,)), [5, 7, 8], [5, 7], FinishReason.STOP, 7),
        (dict(stop_token_ids=(7,), min_tokens=2), [7, 6, 7, 8], [7, 6, 7], FinishReason.STOP, 7),
        (dict(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        (dict(eos_token_ids={2}, max_tokens=2), [5, 2], [5, 2], FinishReason.STOP, None),  # eos checked first
        (dict(eos_token_ids={2}, min_tokens=3, max_tokens=2), [2, 2], [2, 2], FinishReason.LENGTH, None),
        (dict(max_tokens=None), [5] * 20, [5] * 6, FinishReason.LENGTH, None),  # 6 prompt + 6 = max_model_len
    ],
)
def test_stop_conditions(params, script, expected_tokens, reason, stop_reason):
    config = make_config(max_model_len=12)
    scheduler = Scheduler(config)
    runner = FakeRunner(config, script={"r": list(script)})
    scheduler.add_request(make_request("r", [1, 1, 1, 1, 1, 1], 0.0, **params))
    updates = []
    while scheduler.has_unfinished_requests():
        updates.extend(run_step(scheduler, runner)[1])
    assert [t for u in updates for t in u.new_token_ids] == expected_tokens
    assert [u.finish_reason for u in updates] == [None] * (len(updates) - 1) + [reason]
    assert updates[-1].stop_reason == stop_reason
    assert scheduler.block_pool.num_free_blocks == config.num_blocks - 1


def test_prompt_length_limits():
    scheduler = Scheduler(make_config(max_model_len=8))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", [1] * 9, 0.0))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("empty", [], 0.0))
    scheduler.add_request(make_request("fits", [1] * 8, 0.0))
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request(make_request("fits", [1] * 8, 0.0))
    runner = FakeRunner(scheduler.config)
    _, (update,) = run_step(scheduler, runner)
    assert update.finish_reason is FinishReason.LENGTH and len(update.new_token_ids) == 1


def test_update_requires_a_token_for_every_sampling_request():
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("a", [1, 2, 3], 0.0))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(output, {})
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(output, {"a": []})
    assert scheduler.requests["a"].num_computed_tokens == 0
    assert scheduler.update(output, {"a": [5]})[0].new_token_ids == [5]


def test_config_rejects_a_cache_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=8, max_model_len=32, block_size=4)  # needs 8 + the null block
    EngineConfig(num_blocks=9, max_model_len=32, block_size=4)


def test_siblings_share_once_the_first_computed_the_prompt():
    config = make_config(num_blocks=30)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(100, 109))
    for i in range(2):
        scheduler.add_request(make_request(f"s{i}", prompt, 0.0, max_tokens=3))
    output, _ = run_step(scheduler, runner)
    assert [s.new_block_ids for s in output.scheduled] == [[1, 2, 3], [4, 5, 6]]  # same step: nothing shared
    events = scheduler.take_kv_events()
    assert events == [Stored(hash_blocks(prompt, 4, b"fp", ""), None)]  # each hash stored once
    scheduler.add_request(make_request("s2", prompt, 0.0, max_tokens=3))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled[-1].is_new and output.scheduled[-1].new_block_ids[:2] == [1, 2]
    outputs = run_to_completion(scheduler, runner)
    assert outputs["s2"] == reference_output(prompt, 3)[1:]


def test_random_workload_keeps_invariants_and_outputs():
    rng = random.Random(7)
    config = make_config(num_blocks=14, max_model_len=40, max_num_batched_tokens=12, max_num_seqs=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    expected, outputs, aborted = {}, {}, set()
    for step in range(300):
        if step < 60 and rng.random() < 0.4:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(rng.randrange(0, 6))]
            max_tokens = rng.randrange(1, 12)
            scheduler.add_request(make_request(rid, prompt, float(step), max_tokens=max_tokens))
            expected[rid] = reference_output(prompt, max_tokens)
        if rng.random() < 0.03 and scheduler.requests:
            rid = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests([rid])
            aborted.add(rid)
        if step >= 60 and not scheduler.has_unfinished_requests():
            break
        _, updates = run_step(scheduler, runner)
        for u in updates:
            outputs.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_pool.num_free_blocks == config.num_blocks - 1
    finished = set(expected) - aborted
    assert finished and all(outputs[rid] == expected[rid] for rid in finished)
    assert any(s.preempted_request_ids for s in runner.steps), "the workload should exercise preemption"


def test_policy_modules_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import deepinfer.engine.scheduler, deepinfer.engine.block_pool, deepinfer.engine.kv_manager\n"
        "import deepinfer.engine.chunk_timer\n"
        "import deepinfer.hashing\n"
        "assert sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
