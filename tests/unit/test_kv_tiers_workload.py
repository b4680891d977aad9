"""deepinfer.bench.kv_workload (bench/kv/kv_tiers.py's workloads): prompt sizing, pool arithmetic, the multi-turn
plan (pure functions)."""

from __future__ import annotations

import pytest

from deepinfer.bench import kv_workload as workload


def count_words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.mark.parametrize("target", [100, 1000, 8192])
def test_num_facts_for_reaches_the_target_without_passing_it(target: int) -> None:
    facts = workload.num_facts_for(target, count_words)
    goal = target - workload.TEMPLATE_TOKENS
    tokens = count_words(workload.long_prompts(1, facts)[0][0]["content"])
    one_more = count_words(workload.long_prompts(1, facts + 1)[0][0]["content"])
    assert tokens <= goal < one_more


def test_long_prompts_differ_from_their_first_words() -> None:
    prompts = workload.long_prompts(3, 20) + workload.long_prompts(2, 20, workload.FILLER_OFFSET)
    firsts = {tuple(p[0]["content"].split()[:2]) for p in prompts}
    assert len(firsts) == 5


def test_pool_bytes_and_tokens_round_trip_in_whole_blocks() -> None:
    size = workload.pool_bytes(1500, bytes_per_token=100, block_size=16)
    assert size == (94 + 1) * 16 * 100  # ceil(1500 / 16) blocks and the reserved block 0
    assert workload.pool_tokens_of(size, 100, 16) == 94 * 16


def test_fillers_allocate_more_than_the_pool() -> None:
    assert workload.num_fillers(1488, 1000) == 2  # 1.25 x 1488 = 1860 tokens
    assert workload.num_fillers(49152, 8192) == 8
    assert workload.num_fillers(100, 1000) == 1


def test_max_model_len_fits_the_longest_request_in_whole_blocks() -> None:
    length = workload.max_model_len(32768, 16, 16)
    assert length % 16 == 0 and length >= 32768 + 16


def test_multi_turn_working_set_is_the_ratio_of_the_pool() -> None:
    plan = workload.plan_multi_turn(pool_tokens=1000, context_tokens=256, turns=3, turn_tokens=50,
                                    context_facts=10, working_set_ratio=4.0)
    assert plan.final_tokens == 356
    assert plan.num_conversations == 12  # ceil(4000 / 356)
    assert plan.working_set_tokens >= 4 * 1000 > (plan.num_conversations - 1) * plan.final_tokens


def test_round_robin_visits_every_conversation_before_its_next_turn() -> None:
    assert workload.round_robin(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_turns_append_the_answer_and_a_new_question() -> None:
    first = workload.first_turn(4, 5)
    second = workload.next_turn(first, "an answer", 4, 1)
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "an answer"}
    assert second[-1]["role"] == "user" and second[-1]["content"] != first[-1]["content"]


def test_tier_totals_sum_each_tier_and_skip_missing_fields() -> None:
    totals = workload.tier_totals([{"device": 16, "store": 96}, None, {"device": 32, "host": 48}])
    assert totals == {"device": 48, "store": 96, "host": 48}


@pytest.mark.parametrize(("by_tier", "expected"), [
    ({"device": 0, "store": 992}, "store"),
    ({"device": 32, "host": 960}, "host"),
    ({"device": 32, "store": 0}, "recompute"),
    (None, "recompute"),
    ({"device": 600, "store": 400}, "device"),
])
def test_served_tier(by_tier, expected: str) -> None:
    assert workload.served_tier(by_tier, 1000) == expected
