"""deepinfer.bench.pyspy_summary: py-spy raw stacks folded per thread into self and inclusive shares."""

from __future__ import annotations

from deepinfer.bench import pyspy_summary

RAW = [
    "thread (1): MainThread;run (asyncio/base_events.py:641);select (selectors.py:468) 6",
    "thread (2): engine;step (deepinfer/engine/core.py:249);launch (triton/runtime/jit.py:600) 3",
    "thread (2): engine;step (deepinfer/engine/core.py:249);step_ms (bench/gpu/mixed_step.py:70);"
    "replay (torch/cuda/graphs.py:90) 1",
    "not a stack line",
]


def test_frames_are_shortened_to_function_file_and_line():
    assert pyspy_summary.short("launch (triton/runtime/jit.py:600)") == "launch jit.py:600"
    assert pyspy_summary.short("<module> (<frozen runpy>)") == "<module> <frozen runpy>"


def test_each_thread_gets_its_self_and_inclusive_shares():
    folded = pyspy_summary.fold(RAW, match=None)
    samples, leaves, inclusive = folded["thread (2): engine"]
    assert samples == 4 and leaves == {"launch jit.py:600": 3, "replay graphs.py:90": 1}
    assert inclusive["step core.py:249"] == 4
    text = pyspy_summary.render(folded, top=2)
    assert text.index("thread (1)") < text.index("thread (2)")  # the busiest thread first
    assert "leaf  75.0% launch jit.py:600" in text and "incl 100.0% step core.py:249" in text


def test_match_keeps_only_the_stacks_through_a_frame():
    folded = pyspy_summary.fold(RAW, match="step_ms")
    assert list(folded) == ["thread (2): engine"] and folded["thread (2): engine"][0] == 1
