"""Usable cores (cgroup v2 cpu.max, else the affinity) and the gateway process count that follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.config import GatewaySettings
from deepinfer.cpus import (
    affinity_cpus,
    cgroup_cpu_limit,
    default_gateway_processes,
    default_num_schedulers,
    own_cgroup,
    parse_cpu_max,
    usable_cpus,
)


@pytest.mark.parametrize(
    ("text", "cores"),
    [("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5),
     ("400000", 4.0), ("", None), ("garbage x", None), ("0 100000", None)],
)
def test_parse_cpu_max(text: str, cores: float | None):
    assert parse_cpu_max(text) == cores


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpu.max").write_text(text)


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path):
    write(tmp_path, "max 100000\n")
    write(tmp_path / "kubepods", "800000 100000\n")
    write(tmp_path / "kubepods" / "pod1" / "ctr", "300000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "/kubepods/pod1/ctr") == 3.0
    assert cgroup_cpu_limit(tmp_path, "/kubepods") == 8.0
    assert cgroup_cpu_limit(tmp_path, "/") is None  # "max": no limit
    assert cgroup_cpu_limit(tmp_path / "missing", "/") is None  # cgroup v1 or no cgroupfs


def test_own_cgroup_reads_the_v2_line(tmp_path: Path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n0::/system.slice/app.service\n")
    assert own_cgroup(proc) == "/system.slice/app.service"
    proc.write_text("1:cpu:/\n")  # v1 only
    assert own_cgroup(proc) == "/"
    assert own_cgroup(tmp_path / "none") == "/"


def test_usable_cpus_is_the_quota_capped_by_the_affinity(tmp_path: Path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    write(tmp_path, "max 100000\n")
    assert usable_cpus(tmp_path, proc) == affinity_cpus()
    write(tmp_path, "50000 100000\n")  # half a core still runs one process
    assert usable_cpus(tmp_path, proc) == 1
    write(tmp_path, "100000000 100000\n")  # a quota above the CPUs we may run on
    assert usable_cpus(tmp_path, proc) == affinity_cpus()


def test_default_gateway_processes():
    assert [default_gateway_processes(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == [1, 1, 1, 1, 2, 3, 4, 4]


def test_gateway_processes_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DEEPINFER_GATEWAY_PROCESSES", "3")
    assert GatewaySettings().resolved_processes() == 3
    monkeypatch.delenv("DEEPINFER_GATEWAY_PROCESSES")
    assert GatewaySettings().processes is None
    assert GatewaySettings().resolved_processes() == default_gateway_processes()
    with pytest.raises(ValueError):
        GatewaySettings(processes=0)


def test_up_runs_two_schedulers_from_four_cores():
    assert [default_num_schedulers(n) for n in (1, 2, 3, 4, 64)] == [1, 1, 1, 2, 2]


def test_bf16_instructions_read_from_the_cpuinfo_flags(tmp_path: Path):
    from deepinfer.cpus import has_bf16_instructions

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\nflags\t: fpu\n")
    assert has_bf16_instructions(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n")
    assert has_bf16_instructions(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n")  # no bf16: float32 on such CPUs
    assert not has_bf16_instructions(cpuinfo)
    assert not has_bf16_instructions(tmp_path / "missing")  # macOS, Windows


def test_auto_dtype_is_bfloat16_on_a_cpu_with_bf16_instructions(monkeypatch: pytest.MonkeyPatch):
    import torch

    from deepinfer.engine import EngineArgs, args

    cpu = torch.device("cpu")
    monkeypatch.setattr(args, "has_bf16_instructions", lambda: True)
    assert EngineArgs().resolve_dtype(cpu) == torch.bfloat16
    assert EngineArgs(dtype="float32").resolve_dtype(cpu) == torch.float32  # the way back
    monkeypatch.setattr(args, "has_bf16_instructions", lambda: False)
    assert EngineArgs().resolve_dtype(cpu) == torch.float32
    assert EngineArgs().resolve_dtype(torch.device("meta")) == torch.bfloat16  # any accelerator
