"""Which device each local worker gets: round-robin over the GPUs, the memory share split when they share one.

Torch is never imported here (`deepinfer up` stays light): GPUs are counted with `nvidia-smi -L`.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass

from deepinfer.config import WorkerSettings

DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class WorkerDevice:
    """A worker's device setting, and its share of device memory when it shares a GPU (None: the default)."""

    device: str
    gpu_memory_utilization: float | None = None


def count_nvidia_gpus(timeout_s: float = 10.0) -> int:
    """Number of NVIDIA GPUs `nvidia-smi -L` lists (0 without the tool or on any failure)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        result = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if result.returncode != 0:
        return 0
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def plan_devices(device: str, num_workers: int, num_gpus: int) -> list[WorkerDevice]:
    """Devices for `num_workers` workers: cpu stays cpu; cuda (or auto with GPUs) spreads over `num_gpus`.

    Workers sharing one GPU split the default memory fraction between them; `auto` without an NVIDIA GPU is
    passed on as `auto` (the worker picks, e.g. an NPU, else the CPU).
    """
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}")
    if device == "cpu":
        return [WorkerDevice("cpu") for _ in range(num_workers)]
    if num_gpus <= 0:
        return [WorkerDevice(device) for _ in range(num_workers)]
    assigned = [f"cuda:{index % num_gpus}" for index in range(num_workers)]
    sharing = Counter(assigned)
    default = float(WorkerSettings.model_fields["gpu_memory_utilization"].default)
    return [
        WorkerDevice(name, round(default / sharing[name], 3) if sharing[name] > 1 else None)
        for name in assigned
    ]


def default_num_prefill(device: str, num_gpus: int) -> int:
    """Prefill workers `deepinfer up` starts unless told: none when every worker would share one GPU, else one.

    Two processes on one GPU (no MPS) run by time slices: measured on one H200 (docs/serving-path.md), a
    separate prefill worker made the decode worker's prompts wait for the other process's slices, and a decode
    worker computing prompts itself gave more tokens/s and half the TTFT. On the CPU the split stays (it is the
    disaggregated path the tests and the demo exercise); with two GPUs or more, prefill gets its own.
    """
    return 0 if device != "cpu" and num_gpus == 1 else 1
