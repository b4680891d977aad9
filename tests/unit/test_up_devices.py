"""Where `deepinfer up` puts workers: devices and memory shares per GPU, and how many prefill workers by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.up.devices import WorkerDevice, default_num_prefill, plan_devices
from deepinfer.up.stack import Stack


@pytest.mark.parametrize(
    ("device", "num_workers", "num_gpus", "expected"),
    [
        ("cpu", 2, 8, [WorkerDevice("cpu"), WorkerDevice("cpu")]),
        ("auto", 2, 0, [WorkerDevice("auto"), WorkerDevice("auto")]),
        ("cuda", 2, 2, [WorkerDevice("cuda:0"), WorkerDevice("cuda:1")]),
        ("auto", 2, 1, [WorkerDevice("cuda:0", 0.45), WorkerDevice("cuda:0", 0.45)]),
        ("cuda", 3, 2, [WorkerDevice("cuda:0", 0.45), WorkerDevice("cuda:1"), WorkerDevice("cuda:0", 0.45)]),
    ],
)
def test_plan_devices(device, num_workers, num_gpus, expected):
    assert plan_devices(device, num_workers, num_gpus) == expected


@pytest.mark.parametrize(
    ("device", "num_gpus", "expected"),
    [("auto", 1, 0), ("cuda", 1, 0), ("auto", 2, 1), ("cuda", 8, 1), ("cpu", 1, 1), ("cpu", 0, 1), ("auto", 0, 1)],
)
def test_one_gpu_gets_no_separate_prefill_worker_by_default(tmp_path: Path, device, num_gpus, expected):
    assert default_num_prefill(device, num_gpus) == expected
    stack = Stack(port=0, device=device, log_dir=tmp_path, num_gpus=num_gpus, base_env={})
    assert stack.num_prefill == expected
    assert Stack(port=0, device=device, num_prefill=2, log_dir=tmp_path, num_gpus=num_gpus).num_prefill == 2


def test_plan_devices_rejects_unknown_device():
    with pytest.raises(ValueError, match="device must be one of"):
        plan_devices("tpu", 1, 0)
