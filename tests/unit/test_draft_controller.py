"""The adaptive draft length's controller (`num_speculative_tokens: "auto"`): given acceptance histories and a
cost table, exactly these draft lengths (rule and constants: engine/draft_controller.py, docs/speculative.md)."""

from __future__ import annotations

import pytest

from deepinfer.engine.draft_controller import DECAY, DraftController, StepCostTable


def controller_with(costs: dict[tuple[int, int], float]) -> DraftController:
    controller = DraftController()
    for (rows, tokens), seconds in costs.items():
        controller.observe_step(rows, tokens, seconds)
    return controller


def test_the_cost_of_an_unmeasured_cell_lies_on_the_line_between_its_measured_neighbours():
    table = StepCostTable()
    table.observe(2, 2, 1.0)
    table.observe(2, 5, 4.0)
    assert [table.cost(2, t) for t in (2, 3, 4, 5, 9)] == [1.0, 2.0, 3.0, 4.0, 4.0]  # above the last: the last
    table.observe(2, 3, 1.5)
    assert [table.cost(2, t) for t in (3, 4)] == [1.5, pytest.approx(2.75)]
    assert table.cost(1, 3) is None and table.cost(3, 3) is None and table.cost(2, 1) is None
    table.observe(2, 2, 2.0)  # a moving average: a quarter weight on the newest
    assert table.cost(2, 2) == pytest.approx(1.25)


def test_nothing_is_verified_before_a_plain_step_of_the_batch_was_measured():
    assert DraftController().draft_lengths({"a": 4, "b": 0}) == {"a": 0, "b": 0}


def test_free_drafts_are_all_verified_at_the_prior_acceptance():
    # Only the plain step measured: every draft token costs nothing yet (optimistic, so it gets measured).
    controller = controller_with({(1, 1): 0.1})
    assert controller.acceptance("a") == 0.5
    assert controller.draft_lengths({"a": 5}) == {"a": 5}


def test_the_length_maximises_expected_tokens_per_second():
    # Acceptance 0.5: position i adds 0.5 ** i tokens. Steps of 1 + d tokens cost 1.0, 1.2, 1.3, 1.6, 2.0 s:
    # d = 0: 1/1.0; d = 1: 1.5/1.2 = 1.25; d = 2: 1.75/1.3 = 1.346; d = 3: 1.875/1.6 = 1.17; d = 4: 1.94/2.0.
    controller = controller_with({(1, 1): 1.0, (1, 2): 1.2, (1, 3): 1.3, (1, 4): 1.6, (1, 5): 2.0})
    assert controller.draft_lengths({"a": 4}) == {"a": 2}
    assert controller.draft_lengths({"a": 1}) == {"a": 1}  # never more than proposed


def test_a_request_whose_drafts_miss_stops_drafting_and_recovers_when_they_hit():
    controller = controller_with({(1, 1): 1.0, (1, 2): 1.2, (1, 3): 1.4, (1, 4): 1.6, (1, 5): 1.8})
    for _ in range(3):  # each tried one position (the first) and missed
        controller.observe_draft("a", 4, 0)
    assert controller.acceptance("a") == pytest.approx(DECAY ** 3 * 1.0 / (DECAY ** 3 * 2.0 + 1 + DECAY + DECAY ** 2))
    assert controller.draft_lengths({"a": 4}) == {"a": 0}  # 0.06 expected tokens do not pay 0.2 s
    for _ in range(4):  # unverified drafts whose first token was the emitted one
        controller.observe_unverified("a", 7, 7)
    assert controller.acceptance("a") > 0.8
    assert controller.draft_lengths({"a": 4}) == {"a": 4}


def test_under_load_the_drafts_of_a_batch_shrink_to_none():
    # Four rows, acceptance 0.5 each: at batch 4 an extra query token costs as much as a row (compute-bound).
    controller = controller_with({(4, 4): 1.0, (4, 5): 1.25, (4, 6): 1.5, (4, 8): 2.0})
    assert controller.draft_lengths({"a": 3, "b": 3, "c": 0, "d": 2}) == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_the_best_positions_of_a_batch_go_to_the_requests_that_accept_most():
    # a accepts well (0.9 of tried positions), b poorly (prior 0.5 pulled down by misses).
    controller = controller_with({(2, 2): 1.0, (2, 3): 1.05, (2, 4): 1.1, (2, 5): 1.15, (2, 6): 1.6})
    for _ in range(10):
        controller.observe_draft("a", 4, 4)
        controller.observe_draft("b", 4, 0)
    # a: 0.99+, 0.98+, 0.97+ ... b: ~0.03. Costs rise 0.05 a token up to 3 drafts, then 0.45: a gets 3, b none.
    assert controller.draft_lengths({"a": 4, "b": 4}) == {"a": 3, "b": 0}


def test_state_of_requests_gone_is_dropped():
    controller = DraftController()
    controller.observe_draft("a", 2, 2)
    controller.observe_draft("b", 2, 0)
    controller.retain({"b"})
    assert controller.acceptance("a") == 0.5 and controller.acceptance("b") < 0.5


def test_one_measured_long_step_prices_the_shorter_ones():
    # Plain 1.0 s at 4 rows; the first (optimistic) try verified 16 drafts in 4.0 s: each draft costs ~0.19 s on the
    # line, more than the 0.5 ** i tokens it adds (1 token a row costs 0.25 s), so the next step verifies none.
    controller = controller_with({(4, 4): 1.0})
    assert sum(controller.draft_lengths({r: 4 for r in "abcd"}).values()) == 16
    controller.observe_step(4, 20, 4.0)
    assert controller.draft_lengths({r: 4 for r in "abcd"}) == dict.fromkeys("abcd", 0)


def test_the_query_token_cap_bounds_rows_and_drafts_together():
    controller = controller_with({(4, 4): 1.0})  # every draft free: all would be verified
    lengths = controller.draft_lengths({"a": 4, "b": 4, "c": 4, "d": 0}, max_query_tokens=10)
    assert sum(lengths.values()) == 6 and lengths["d"] == 0
    assert controller.draft_lengths({"a": 4, "b": 4, "c": 4, "d": 0}, max_query_tokens=3) == dict.fromkeys("abcd", 0)


def test_a_model_drafter_drafts_as_deep_as_pays_its_rounds_included():
    """draft_depth: acceptance 0.8 (one request), a verify step costs 10 ms whatever its tokens (memory-bound), so
    drafts are nearly free to verify; the draft model's rounds decide the depth."""
    controller = controller_with({(1, 1): 0.010, (1, 9): 0.010})
    for _ in range(20):
        controller.observe_draft("a", 4, 3)  # 3 of 4 accepted: tried 4, accepted 3
    rate = controller.acceptance("a")
    assert DraftController().draft_depth(["a"], 8) == 0  # no plain step measured yet
    assert controller.draft_depth(["a"], 8) == 8  # rounds never measured cost nothing (optimistic)
    # A round of depth d costs 1 ms a position: emitted/s = (1 + sum rate^i) / (10 ms + d ms), best at this depth.
    for depth in range(1, 9):
        controller.observe_draft_round(1, depth, 0.001 * depth)
    expected = max(range(1, 9), key=lambda d: (1 + sum(rate**i for i in range(1, d + 1))) / (0.010 + 0.001 * d))
    assert controller.draft_depth(["a"], 8) == expected < 8


def test_a_model_drafter_that_never_pays_drafts_one_probe_in_probe_every_calls():
    from deepinfer.engine.draft_controller import PROBE_EVERY

    controller = controller_with({(1, 1): 0.010, (1, 9): 0.010})
    for depth in range(1, 9):
        controller.observe_draft_round(1, depth, 0.050)  # a round costs five plain steps
    depths = [controller.draft_depth(["a"], 8) for _ in range(2 * PROBE_EVERY)]
    assert depths == ([0] * (PROBE_EVERY - 1) + [1]) * 2
