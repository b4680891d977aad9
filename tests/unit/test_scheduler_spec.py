"""Speculative decoding in the scheduler: drafts scheduled with a decode, KV rolled back after a partial accept.

A fake runner (test_scheduler's, extended) writes every fed token, drafts included, into its paged slots and
verifies each draft against the fake model reading the context back through the block table. So a rejected
draft left where a later step reads it, or a block freed while still needed, changes the tokens; the block pool
must end exactly as the run without drafts leaves it (free queue order, cached hashes, KV events).
"""

from __future__ import annotations

from deepinfer.engine.block_pool import Stored
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.sampling.rejection import accepted_prefix
from tests.unit.test_scheduler import (
    FakeRunner,
    check_invariants,
    make_config,
    make_request,
    next_token,
    reference_output,
)


class VerifyingRunner(FakeRunner):
    """FakeRunner that also verifies drafts: the target token of each fed row, the longest agreeing prefix."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verified: list[tuple[int, int]] = []  # (drafts, accepted) of each verified draft

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        plain = [s for s in output.scheduled if not s.num_draft_tokens]
        drafted = [s for s in output.scheduled if s.num_draft_tokens]
        sampled = super().execute(SchedulerOutput(plain, output.preempted_request_ids, output.finished_request_ids,
                                                  output.num_batched_tokens))
        self.apply_block_ids(SchedulerOutput(drafted))
        for sched in drafted:
            table = self.tables[sched.request_id]
            assert len(table) == -(-(sched.num_computed_tokens + sched.num_new_tokens) // self.block_size)
            assert sched.sample and sched.num_new_tokens == len(sched.token_ids) == sched.num_draft_tokens + 1
            for i, token_id in enumerate(sched.token_ids):
                pos = sched.num_computed_tokens + i
                self.slots[table[pos // self.block_size]][pos % self.block_size] = token_id
            targets = []
            for j in range(sched.num_new_tokens):
                end = sched.num_computed_tokens + j + 1
                targets.append(next_token([self.slots[table[p // self.block_size]][p % self.block_size]
                                           for p in range(end)]))
            m = accepted_prefix(sched.token_ids[1:], targets)
            self.verified.append((sched.num_draft_tokens, m))
            sampled[sched.request_id] = targets[: m + 1]
        return sampled


def propose(scheduler: Scheduler, k: int, wrong_every: int) -> None:
    """Draft the reference continuation for every request that decodes next, wrong every `wrong_every`-th."""
    for request in scheduler.running:
        if request.num_tokens - request.num_computed_tokens != 1:
            continue
        full = reference_output(request.prompt_token_ids, request.num_output_tokens + k)
        draft = full[request.num_output_tokens :]
        request.draft_token_ids = [
            t + 1 if (request.num_output_tokens + i + 1) % wrong_every == 0 else t for i, t in enumerate(draft)
        ]


def run(requests: list[Request], k: int, wrong_every: int = 3, **config) -> tuple[Scheduler, dict, list]:
    """Run to the end, drafting k tokens for each decode (k = 0: no drafts); (scheduler, outputs, KV events)."""
    config = make_config(**config)
    scheduler, runner = Scheduler(config), VerifyingRunner(config)
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {}
    events = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        for update in scheduler.update(output, runner.execute(output)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        check_invariants(scheduler)
        for request in scheduler.running:  # the blocks of a step without drafts: none past the computed tokens
            held = len(scheduler.kv_manager.get_blocks(request))
            assert held == -(-request.num_computed_tokens // config.block_size), request
        events += scheduler.take_kv_events()
        if k:
            propose(scheduler, k, wrong_every)
    assert not scheduler.has_unfinished_requests()
    if k:  # drafts were verified: accepted in part where one is wrong, whole where none can be
        assert any(m < n for n, m in runner.verified) == (wrong_every <= k)
        assert any(m > 0 for n, m in runner.verified) == (wrong_every > 1)
    return scheduler, outputs, events


def requests(**params) -> list[Request]:
    return [
        make_request("a", list(range(100, 110)), 0.0, **params),
        make_request("b", [7, 8, 9], 1.0, **params),
        make_request("c", list(range(300, 317)), 2.0, **params),
    ]


def test_partial_accepts_give_the_reference_and_leave_the_pool_as_without_drafts():
    base, base_out, base_events = run(requests(max_tokens=14), k=0, num_blocks=30, max_model_len=40)
    spec, spec_out, spec_events = run(requests(max_tokens=14), k=3, num_blocks=30, max_model_len=40)
    for request_id, prompt in (("a", list(range(100, 110))), ("b", [7, 8, 9]), ("c", list(range(300, 317)))):
        assert spec_out[request_id] == base_out[request_id] == reference_output(prompt, 14)
    # Drafts take a request's next block a step or two early, so in a batch other requests may get other ids;
    # what is free and what is cached (and announced) is the same.
    assert sorted(spec.block_pool.free_block_queue.block_ids()) == sorted(base.block_pool.free_block_queue.block_ids())
    assert spec.block_pool.num_free_blocks == base.block_pool.num_free_blocks == 29
    assert set(spec.block_pool.cached_block_hash_to_block) == set(base.block_pool.cached_block_hash_to_block)
    assert stored_hashes(spec_events) == stored_hashes(base_events) and len(stored_hashes(base_events)) == 5 + 4 + 7


def stored_hashes(events: list) -> list[bytes]:
    """Every hash announced, sorted (a step with drafts may announce two blocks at once); no Removed event."""
    assert all(isinstance(e, Stored) for e in events)
    return sorted(h for e in events for h in e.block_hashes)


def test_a_single_request_leaves_the_same_block_ids_after_every_accept_pattern():
    for wrong_every in (1, 2, 3, 100):
        base, base_out, _ = run([make_request("a", list(range(100, 105)), 0.0, max_tokens=19)], k=0)
        spec, spec_out, _ = run([make_request("a", list(range(100, 105)), 0.0, max_tokens=19)], k=4,
                                wrong_every=wrong_every)
        assert spec_out == base_out
        assert spec.block_pool.free_block_queue.block_ids() == base.block_pool.free_block_queue.block_ids()


def test_stop_token_inside_an_accepted_run_ends_the_request_there():
    prompt = list(range(100, 105))
    stop = reference_output(prompt, 6)[4]  # the fifth output token
    _, base_out, _ = run([make_request("a", prompt, 0.0, max_tokens=19, stop_token_ids=(stop,))], k=0)
    _, spec_out, _ = run([make_request("a", prompt, 0.0, max_tokens=19, stop_token_ids=(stop,))], k=4,
                         wrong_every=100)
    assert spec_out == base_out and spec_out["a"][-1] == stop and len(spec_out["a"]) == 5


def test_drafts_are_cut_to_max_tokens_max_model_len_and_the_budget():
    config = make_config(max_model_len=16, max_num_batched_tokens=32)
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("a", list(range(100, 110)), 0.0, max_tokens=4))
    scheduler.update(scheduler.schedule(), {"a": [1]})
    request = scheduler.requests["a"]
    request.draft_token_ids = [2, 3, 4, 5, 6]
    output = scheduler.schedule()
    (sched,) = output.scheduled
    # max_tokens=4 with 1 out: at most 3 more tokens, so 2 drafts (the step emits up to 3)
    assert (sched.token_ids, sched.num_new_tokens, sched.num_draft_tokens) == ([1, 2, 3], 3, 2)
    assert (output.num_draft_tokens, output.kind) == (2, "decode")
    assert request.draft_token_ids == ()  # taken by the step
    (update,) = scheduler.update(output, {"a": [2, 3, 9]})  # both drafts accepted, then the target's own
    assert update.new_token_ids == [2, 3, 9] and update.finish_reason is not None

    scheduler = Scheduler(config)
    scheduler.add_request(make_request("b", list(range(100, 113)), 0.0, max_tokens=None))
    scheduler.update(scheduler.schedule(), {"b": [1]})
    scheduler.requests["b"].draft_token_ids = [2, 3, 4, 5, 6]
    (sched,) = scheduler.schedule().scheduled  # 14 tokens, max_model_len 16: one more token may be drafted
    assert (sched.num_new_tokens, sched.num_draft_tokens) == (2, 1)

    scheduler = Scheduler(make_config(max_model_len=16, max_num_batched_tokens=4))
    scheduler.add_request(make_request("c", [5, 6], 0.0, max_tokens=None))
    scheduler.update(scheduler.schedule(), {"c": [1]})
    scheduler.requests["c"].draft_token_ids = [2, 3, 4, 5, 6]
    (sched,) = scheduler.schedule().scheduled  # budget 4: the last token and 3 drafts
    assert (sched.num_new_tokens, sched.num_draft_tokens) == (4, 3)


def test_a_draft_never_preempts_it_decodes_plainly_instead():
    config = make_config(num_blocks=4, max_model_len=8, block_size=4)  # 3 usable blocks
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("a", [1, 2, 3], 0.0, max_tokens=None))
    scheduler.add_request(make_request("b", [4, 5, 6, 7, 8], 1.0, max_tokens=None))
    output = scheduler.schedule()
    scheduler.update(output, {"a": [9], "b": [9]})  # a: 4 tokens in 1 block; b: 6 tokens in 2 blocks
    assert scheduler.block_pool.num_free_blocks == 0
    scheduler.requests["a"].draft_token_ids = [10, 11]  # would need a second block
    output = scheduler.schedule()
    assert [(s.request_id, s.num_new_tokens, s.num_draft_tokens) for s in output.scheduled] == [("a", 1, 0),
                                                                                                ("b", 1, 0)]
    assert not output.preempted_request_ids
