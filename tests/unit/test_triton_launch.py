"""When a Triton launch may be recorded for replay (deepinfer.kernels.triton_launch); the replays themselves run
on CUDA only: tests/gpu/test_kernels_gpu.py::test_attention_plan_replays_match_each_layer."""

from __future__ import annotations

import torch
from triton import knobs

from deepinfer.kernels import triton_launch


def test_a_launch_hook_turns_recording_off():
    assert not triton_launch._launch_hooks_set()  # Triton 3.6: empty hook chains

    def hook(metadata) -> None:  # a profiler's
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert triton_launch._launch_hooks_set()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not triton_launch._launch_hooks_set()


def test_nothing_is_recorded_off_cuda():
    assert triton_launch.LaunchRecorder([torch.zeros(4)]).launches is None
