"""The loading state (KV from the kvcache store): a request waits in WAITING_FOR_REMOTE_KVS holding its blocks while
the others keep running, then runs only its tokens not loaded; a failed load recomputes and never serves the
blocks it was filling; a preempted request resumes through it (Scheduler.resume_loader). Driven by test_scheduler's
FakeRunner (a paged cache of token ids), step by step."""

from __future__ import annotations

from deepinfer.engine.request import RequestStatus
from deepinfer.engine.scheduler import Scheduler
from tests.unit.test_scheduler import (
    FakeRunner,
    check_invariants,
    make_config,
    make_request,
    reference_output,
    run_step,
    run_to_completion,
)

PROMPT_A = [11, 12, 13, 14, 15, 16]  # 6 tokens
PROMPT_B = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]  # 14 tokens: 3 full blocks before the last


def fill(runner: FakeRunner, prompt: list[int], first_block: int, block_ids: list[int], block_size: int = 4) -> None:
    """What a load from the store does: the blocks receive the KV (here: the token ids) of their positions."""
    for i, block_id in enumerate(block_ids):
        start = (first_block + i) * block_size
        runner.slots[block_id] = list(prompt[start : start + block_size])


def scheduled(output) -> dict[str, tuple[int, int, bool]]:
    return {s.request_id: (s.num_computed_tokens, s.num_new_tokens, s.is_new) for s in output.scheduled}


def test_a_loading_request_waits_while_others_run_then_computes_only_what_was_not_loaded():
    config = make_config(num_blocks=16)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add_request(make_request("a", PROMPT_A, 0.0, max_tokens=6))
    out, _ = run_step(scheduler, runner)
    assert scheduled(out) == {"a": (0, 6, True)}

    b = make_request("b", PROMPT_B, 1.0, max_tokens=3)
    first_block, block_ids = scheduler.add_loading_request(b, 3)
    assert (first_block, len(block_ids)) == (0, 3)
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS and scheduler.loading == {"b": b}
    check_invariants(scheduler)
    for _ in range(2):  # the blocks have not arrived: only a runs
        out, _ = run_step(scheduler, runner)
        assert set(scheduled(out)) == {"a"}
    assert all(scheduler.block_pool.blocks[i].block_hash is None for i in block_ids)  # not cached while loading

    fill(runner, PROMPT_B, first_block, block_ids)
    scheduler.finish_loading("b", loaded=True)
    assert all(scheduler.block_pool.blocks[i].block_hash is not None for i in block_ids)  # cached once loaded
    out, updates = run_step(scheduler, runner)
    assert scheduled(out) == {"a": (8, 1, False), "b": (12, 2, True)}  # 12 loaded tokens, 2 computed
    assert out.scheduled[1].new_block_ids[:3] == block_ids
    update_b = next(u for u in updates if u.request_id == "b")
    assert (update_b.num_cached_tokens, update_b.num_store_cached_tokens) == (12, 12)

    outputs = run_to_completion(scheduler, runner)
    assert [update_b.new_token_ids[0], *outputs["b"]] == reference_output(PROMPT_B, 3)


def test_a_failed_load_recomputes_and_never_serves_the_blocks_it_was_filling():
    config = make_config(num_blocks=16)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add_request(make_request("warm", PROMPT_B[:5], 0.0, max_tokens=1))  # caches PROMPT_B's first block
    run_to_completion(scheduler, runner)

    c = make_request("c", PROMPT_B, 1.0, max_tokens=3)
    first_block, block_ids = scheduler.add_loading_request(c, 3)
    assert (first_block, len(block_ids)) == (1, 2)  # block 0 is a device hit, blocks 1-2 come from the store
    for block_id in block_ids:
        runner.slots[block_id] = [999] * 4  # a half-done load: garbage in the blocks
    scheduler.finish_loading("c", loaded=False)
    assert c.status is RequestStatus.WAITING and not scheduler.loading
    assert all(scheduler.block_pool.blocks[i].block_hash is None for i in block_ids)
    check_invariants(scheduler)

    out, updates = run_step(scheduler, runner)
    assert scheduled(out) == {"c": (4, 10, True)}  # the device hit stays; the rest is recomputed
    assert (updates[0].num_cached_tokens, updates[0].num_store_cached_tokens) == (4, 0)
    outputs = run_to_completion(scheduler, runner)
    assert [updates[0].new_token_ids[0], *outputs["c"]] == reference_output(PROMPT_B, 3)


def test_abort_while_loading_frees_the_blocks_and_a_late_arrival_is_ignored():
    config = make_config(num_blocks=16)
    scheduler = Scheduler(config)
    free_before = scheduler.block_pool.num_free_blocks
    _, block_ids = scheduler.add_loading_request(make_request("d", PROMPT_B, 0.0), 3)
    assert scheduler.block_pool.num_free_blocks == free_before - 3
    assert not scheduler.has_unfinished_requests()  # no step can serve it: the engine loop waits for commands
    scheduler.abort_requests(["d"])
    assert scheduler.block_pool.num_free_blocks == free_before and not scheduler.loading
    scheduler.finish_loading("d", loaded=True)  # the fetch completed after the abort
    assert "d" not in scheduler.requests
    check_invariants(scheduler)


def test_nothing_to_load_or_no_room_leaves_the_scheduler_unchanged():
    config = make_config(num_blocks=16, max_num_seqs=1)
    scheduler = Scheduler(config)
    assert scheduler.add_loading_request(make_request("short", PROMPT_B[:4], 0.0), 1) is None  # last token: computed
    assert scheduler.add_loading_request(make_request("e", PROMPT_B, 0.0), 3) is not None
    assert scheduler.add_loading_request(make_request("f", PROMPT_B, 1.0), 3) is None  # max_num_seqs: e loads
    assert set(scheduler.requests) == {"e"}
    small = Scheduler(make_config(num_blocks=9, max_model_len=32))
    small.add_request(make_request("g", list(range(100, 128)), 0.0))
    small.schedule()  # g holds 7 of the 8 usable blocks
    assert small.add_loading_request(make_request("h", PROMPT_B, 1.0), 3) is None
    assert set(small.requests) == {"g"} and not small.loading


def test_a_preempted_request_is_offered_to_the_resume_loader_at_the_head_of_the_queue():
    # test_preemption_by_recompute's run (b preempted in step 3; a evicts b's tail block in step 7, finishes in
    # step 10), with a lower tier that holds every block b computed: b resumes by loading its tail block.
    config = make_config(num_blocks=6, max_model_len=20)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt_a, prompt_b = list(range(100, 107)), list(range(300, 307))
    scheduler.add_request(make_request("a", prompt_a, 0.0, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_b, 1.0, max_tokens=10))
    b = scheduler.requests["b"]
    offers, plans = [], []

    def resume_loader(request) -> bool:
        offers.append((len(runner.steps) + 1, request.request_id))
        plan = scheduler.add_loading_request(request, len(request.block_hashes))
        plans.append(plan)
        return plan is not None

    scheduler.resume_loader = resume_loader
    for _ in range(11):
        out, _ = run_step(scheduler, runner)
    # Offered in every step that admits while b waits at the head; steps 4-6: its blocks are on the device (nothing
    # to load); 7-10: a's decode took the tail block (before admission) and holds every other one (no room);
    # 11: a finished, b loads its tail block past the device hit.
    assert offers == [(step, "b") for step in range(4, 12)]
    assert plans[:7] == [None] * 7 and plans[7] == (1, plans[7][1]) and len(plans[7][1]) == 1
    assert scheduled(out) == {} and b.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not scheduler.waiting
    check_invariants(scheduler)

    scheduler.finish_loading("b", loaded=False)  # the copy failed: back in the queue as a preempted request
    assert b.status is RequestStatus.PREEMPTED and list(scheduler.waiting) == [b]
    check_invariants(scheduler)
    first_block, block_ids = scheduler.add_loading_request(b, len(b.block_hashes))  # offered again: it loads
    fill(runner, b.all_token_ids, first_block, block_ids)
    scheduler.finish_loading("b", loaded=True, num_host_blocks=1)
    out, updates = run_step(scheduler, runner)
    assert scheduled(out) == {"b": (8, 1, True)}  # 7 prompt tokens and 2 outputs: the 9th is computed
    assert (updates[0].num_cached_tokens, updates[0].num_host_cached_tokens) == (0, 0)  # its admission's usage
    run_to_completion(scheduler, runner)
    assert b.output_token_ids == reference_output(prompt_b, 10)  # read back through the loaded block
