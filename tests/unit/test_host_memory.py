"""Host memory from cgroup v2 limits and /proc/meminfo; the host tier's default size from it."""

from __future__ import annotations

from deepinfer.engine.memory import default_host_tier_bytes
from deepinfer.host_memory import cgroup_memory_limit, usable_memory

GIB = 1 << 30


def cgroups(tmp_path, limits: dict[str, str]):
    for rel, value in limits.items():
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "memory.max").write_text(value + "\n")
    return tmp_path


def test_the_tightest_limit_of_the_cgroup_and_its_ancestors(tmp_path):
    root = cgroups(tmp_path, {".": "max", "kubepods": str(64 * GIB), "kubepods/pod1": "max",
                              "kubepods/pod1/c": str(16 * GIB)})
    assert cgroup_memory_limit(root, "/kubepods/pod1/c") == 16 * GIB
    assert cgroup_memory_limit(root, "/kubepods/pod1") == 64 * GIB
    assert cgroup_memory_limit(root, "/") is None


def test_usable_memory_is_the_limit_capped_by_memtotal(tmp_path):
    root = cgroups(tmp_path / "cg", {".": str(512 * GIB)})
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {32 * GIB // 1024} kB\nMemFree:  1 kB\n")
    self_cgroup = tmp_path / "cgroup"
    self_cgroup.write_text("0::/\n")
    assert usable_memory(root, self_cgroup, meminfo) == 32 * GIB
    (root / "memory.max").write_text(str(12 * GIB))
    assert usable_memory(root, self_cgroup, meminfo) == 12 * GIB
    assert usable_memory(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None


def test_default_host_tier_is_a_power_of_two_within_a_quarter_of_memory():
    assert default_host_tier_bytes(None) == 8 * GIB
    assert default_host_tier_bytes(2048 * GIB) == 8 * GIB
    assert default_host_tier_bytes(24 * GIB) == 4 * GIB  # a quarter is 6 GiB: the power of two below
    assert default_host_tier_bytes(2 * GIB) == GIB // 2
    assert default_host_tier_bytes(512 << 20) == 0  # under 256 MiB: off
