"""The host memory this process may use: the tightest cgroup v2 limit (`memory.max` of its cgroup and its
ancestors: a container's or pod's memory limit) when one is set, else the machine's (MemTotal)."""

from __future__ import annotations

from pathlib import Path

from deepinfer.cpus import CGROUP_ROOT, PROC_SELF_CGROUP, own_cgroup

MEMINFO = Path("/proc/meminfo")


def cgroup_memory_limit(cgroup_root: Path = CGROUP_ROOT, cgroup: str = "/") -> int | None:
    """The tightest `memory.max` (bytes) on `cgroup` and its ancestors under `cgroup_root`; None when none is set."""
    limits = []
    path = cgroup_root / cgroup.strip("/")
    while True:
        try:
            text = (path / "memory.max").read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit():
            limits.append(int(text))
        if path == cgroup_root or cgroup_root not in path.parents:
            break
        path = path.parent
    return min(limits) if limits else None


def total_memory(meminfo: Path = MEMINFO) -> int | None:
    """MemTotal in bytes; None where /proc/meminfo is missing."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_memory(cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP,
                  meminfo: Path = MEMINFO) -> int | None:
    """Bytes this process may use: the cgroup limit capped by MemTotal; None when neither is known."""
    known = [m for m in (cgroup_memory_limit(cgroup_root, own_cgroup(proc_self_cgroup)), total_memory(meminfo))
             if m is not None]
    return min(known) if known else None
