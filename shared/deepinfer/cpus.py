"""The CPUs this process may use (how many cores, which instructions) and what follows from them (how many gateway
processes to run, the engine's dtype on the CPU).

Usable cores = the cgroup v2 CPU quota (`cpu.max` of this process's cgroup and its ancestors: a container's
CPU limit) when one is set, else the CPUs this process may run on (`os.sched_getaffinity`: cpusets, taskset).
A Kubernetes CPU *request* sets no quota: without a limit a pod sees the node's cores.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_CPUINFO = Path("/proc/cpuinfo")
#: CPU flags (Linux /proc/cpuinfo names) of bf16 dot-product instructions: with them torch's bf16 matmuls run
#: about twice as fast as float32 (bench/cpu/cpu.py; docs/cpu.md).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: Gateway processes per usable core when unset (`GatewaySettings.processes`, `deepinfer up`), and their range.
CORES_PER_GATEWAY = 4
MAX_AUTO_GATEWAYS = 4
#: Usable cores from which `deepinfer up` runs two scheduler replicas instead of one.
CORES_FOR_TWO_SCHEDULERS = 4


def parse_cpu_max(text: str) -> float | None:
    """Cores a cgroup v2 `cpu.max` line allows: "200000 100000" -> 2.0; "max 100000" (no limit) -> None."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def own_cgroup(proc_self_cgroup: Path = PROC_SELF_CGROUP) -> str:
    """This process's cgroup v2 path ("/kubepods/pod.../abc"), from the `0::<path>` line; "/" if none."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return "/"


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, cgroup: str = "/") -> float | None:
    """The tightest CPU quota (cores) on `cgroup` and its ancestors under `cgroup_root`; None when none is set.

    In a container the cgroup namespace makes the container's own cgroup the root, so `cgroup_root/cpu.max`
    is the container's limit; on a host the process's cgroup lies below it (systemd slices).
    """
    limits = []
    path = cgroup_root / cgroup.strip("/")
    while True:
        try:
            limit = parse_cpu_max((path / "cpu.max").read_text())
        except OSError:
            limit = None
        if limit is not None:
            limits.append(limit)
        if path == cgroup_root or cgroup_root not in path.parents:
            break
        path = path.parent
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs this process may run on (all of them where sched_getaffinity is missing)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """Whole cores this process may use: the cgroup quota (rounded down, at least 1) capped by the affinity."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(cgroup_root, own_cgroup(proc_self_cgroup))
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return cpus


def default_gateway_processes(num_cpus: int | None = None) -> int:
    """Gateway processes sharing one API port when unset: one per 4 usable cores, 1 to 4. One Python process
    turns a few thousand tokens a second into SSE; measured on one H200 (llama-1b, concurrency 64), 1 gateway
    gave 9.3k output tok/s and 3 gave 20.3k (bench/results/serve-llama-1b-1xh200-gateways*.json @ b8b19c2)."""
    cpus = usable_cpus() if num_cpus is None else num_cpus
    return max(1, min(MAX_AUTO_GATEWAYS, cpus // CORES_PER_GATEWAY))


def default_num_schedulers(num_cpus: int | None = None) -> int:
    """Scheduler replicas `deepinfer up` starts: 2 from CORES_FOR_TWO_SCHEDULERS usable cores (routing survives a
    replica's restart with its prefix-cache credit), else 1: on a smaller machine a second replica's share of every
    heartbeat and KV event costs the workers' cores, and while a lone one restarts (~1.5 s) the gateways route by
    their own heartbeat tables (GatewaySettings.route_fallback), so no request fails either way."""
    cpus = usable_cpus() if num_cpus is None else num_cpus
    return 2 if cpus >= CORES_FOR_TWO_SCHEDULERS else 1


def has_bf16_instructions(cpuinfo: Path = PROC_CPUINFO) -> bool:
    """True when the first `flags` line of /proc/cpuinfo lists a bf16 instruction set (BF16_FLAGS); False when it
    does not, or where there is no such file (macOS, Windows)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return not set(BF16_FLAGS).isdisjoint(line.partition(":")[2].split())
    return False
