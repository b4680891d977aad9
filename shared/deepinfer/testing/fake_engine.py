"""Engine doubles for unit tests, with no model. `ScriptedEngine`: the part of `deepinfer.engine.Engine` that the
worker's engine thread (`EngineLoop`) and its health checks drive: a fixed number of steps, each returning one
output, KV events on every second step, and load numbers the test sets (subclass `run_step` to block, sleep or fail
inside a step). `AdmissionRecorder`: the engine as the worker's store tier admits to it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TypeVar

from deepinfer.engine import Admission, EngineCommand, EngineRequest, EngineStats
from deepinfer.engine.requests import KvSource
from deepinfer.kv_costs import KvCosts
from deepinfer.kv_rates import MeasuredRates

T = TypeVar("T")


class ScriptedEngine:
    """Steps `num_steps` times; step k (from 1) returns [f"out-{k}"] and its KV events are ["stored"] when k is
    even. `load` is what `stats()` reports."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps, self.steps = num_steps, 0
        self.load = EngineStats(num_running=1, num_waiting=0, num_held=0, num_free_blocks=7, num_total_blocks=7,
                                num_added=1)
        self.last_step_kind = "decode"
        self.aborted: list[str] = []

    def bind_thread(self) -> None:
        """Nothing to bind: no device."""

    def has_unfinished_requests(self) -> bool:
        return self.steps < self.num_steps

    def step(self) -> list:
        self.run_step()
        self.steps += 1
        return [f"out-{self.steps}"]

    def run_step(self) -> None:
        """What a step does before it returns (nothing here)."""

    def take_kv_events(self) -> list:
        return ["stored"] if self.steps % 2 == 0 else []

    def stats(self) -> EngineStats:
        return self.load

    def kv_snapshot(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)


class AdmissionRecorder:
    """The engine as the worker's store tier uses it, both its front door and its thread: reads (block size,
    fingerprint, layout id "layout", a CPU `device`, prefix hints: `cached` = (device, host) leading blocks, none
    by default; the measured `rates`, the CPU's priors until a test sets them) and `call(command)`, which applies
    the command to this object at once. Each admitted request's id goes to `added` and its KV source to `kv_sources`; it is
    computed, never loaded."""

    def __init__(self, block_size: int, fingerprint: bytes, has_host_tier: bool = False,
                 kv_bytes_per_block: int = 1024, cached: tuple[int, int] = (0, 0)) -> None:
        self.block_size, self.fingerprint, self.has_host_tier = block_size, fingerprint, has_host_tier
        self.kv_layout = SimpleNamespace(layout_id=lambda: "layout")
        self.kv_bytes_per_block, self.cached = kv_bytes_per_block, cached
        self.rates = MeasuredRates.for_device("cpu")
        self.device = SimpleNamespace(type="cpu")  # the store tier copies slots to the device only on CUDA
        self.added: list[str] = []
        self.kv_sources: dict[str, KvSource] = {}

    async def call(self, command: EngineCommand[T]) -> T:
        return command.apply(self)  # type: ignore[arg-type]

    def add_request(self, request: EngineRequest) -> Admission:
        self.added.append(request.request_id)
        self.kv_sources[request.request_id] = request.kv
        return Admission("computed")

    def cached_prefix_tiers(self, block_hashes) -> tuple[int, int]:
        num_device = min(self.cached[0], len(block_hashes))
        return num_device, min(self.cached[1], len(block_hashes) - num_device)

    def kv_costs(self, store_path: str | None) -> KvCosts:
        return self.rates.costs(self.block_size, self.kv_bytes_per_block, host=self.has_host_tier,
                                store_path=store_path)
