"""ChunkTimer: a step's prompt tokens sized to about target_s of compute, in whole blocks, from measured steps."""

from __future__ import annotations

import pytest

from deepinfer.engine.chunk_timer import ChunkTimer


def test_before_any_step_a_step_takes_the_smallest_measured_size():
    assert ChunkTimer(0.5, block_size=16, max_tokens=2048).max_prefill_tokens == 32
    assert ChunkTimer(0.5, block_size=16, max_tokens=16).max_prefill_tokens == 16


def test_tokens_follow_the_measured_seconds_per_token_in_whole_blocks():
    timer = ChunkTimer(0.5, block_size=16, max_tokens=2048)
    timer.observe(256, 5.12)  # 20 ms a token (the default model on one loaded CPU core)
    assert timer.seconds_per_token == pytest.approx(0.02)
    assert timer.max_prefill_tokens == 16  # 25 tokens, rounded down to one block
    timer.observe(32, 0.32)  # 10 ms: the average moves halfway, to 15 ms → 33 tokens → 2 blocks
    assert timer.seconds_per_token == pytest.approx(0.015)
    assert timer.max_prefill_tokens == 32
    for _ in range(20):
        timer.observe(64, 0.0064)  # 0.1 ms a token: a GPU-fast step, capped at the token budget
    assert timer.max_prefill_tokens == 2048


def test_short_steps_are_not_measured_and_the_floor_is_one_block():
    timer = ChunkTimer(0.5, block_size=16, max_tokens=2048)
    timer.observe(1, 0.03)  # a decode-sized step: its fixed cost would read as 30 ms a token
    timer.observe(31, 3.0)
    assert timer.seconds_per_token is None and timer.max_prefill_tokens == 32
    timer.observe(32, 32.0)  # a second a token: still one block per step, never zero
    assert timer.max_prefill_tokens == 16


def test_one_slow_step_does_not_pin_the_budget_at_one_block():
    """A 6,000-token prompt on the CPU after a slow first step: 16-token steps of 40 ms ran for the rest of the
    prompt (71 tok/s against ~700 in 2,048-token steps) while none of them was measured."""
    timer = ChunkTimer(0.5, block_size=16, max_tokens=2048)
    timer.observe(32, 1.3)  # the first step after start: 40 ms a token
    assert timer.max_prefill_tokens == 16
    timer.observe(16, 0.04)  # 2.5 ms a token: a step of its whole budget is measured
    assert timer.seconds_per_token == pytest.approx((0.04 / 16 + 1.3 / 32) / 2)
    for _ in range(8):
        timer.observe(timer.max_prefill_tokens, 0.0025 * timer.max_prefill_tokens)
    assert timer.max_prefill_tokens >= 160
    timer.observe(8, 0.04)  # a prompt's last few tokens, below the budget: still not measured
    assert timer.max_prefill_tokens >= 160


def test_target_must_be_positive():
    with pytest.raises(ValueError):
        ChunkTimer(0, block_size=16, max_tokens=2048)
