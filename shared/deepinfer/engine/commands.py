"""Work for the engine thread, as values: a service sends a command (`deepinfer.worker.engine_loop.EngineLoop.call`)
and gets its result; the thread that steps the engine applies it between steps. One command per `Engine` method
that changes scheduler state or touches KV tensors; `apply` is the one place each maps to its method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from deepinfer.engine.requests import Admission, EngineRequest, LoadPlan

if TYPE_CHECKING:
    import torch

    from deepinfer.engine.engine import Engine
    from deepinfer.engine.kv_load import CachedPayloads
    from deepinfer.engine.kv_transfer import DeviceRows, StagingChunk, StagingPool
    from deepinfer.protocol.kv import KvDeviceExport

T = TypeVar("T")


class EngineCommand(Generic[T]):
    """A command whose result is a T."""

    __slots__ = ()

    def apply(self, engine: Engine) -> T:
        """Run it (on the engine thread)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class AddRequest(EngineCommand[Admission]):
    """`Engine.add_request`."""

    request: EngineRequest

    def apply(self, engine: Engine) -> Admission:
        return engine.add_request(self.request)


@dataclass(frozen=True, slots=True)
class Abort(EngineCommand[None]):
    """`Engine.abort`."""

    request_ids: Sequence[str]

    def apply(self, engine: Engine) -> None:
        engine.abort(self.request_ids)


@dataclass(frozen=True, slots=True)
class HeldBlockIds(EngineCommand["list[int] | None"]):
    """`Engine.held_block_ids`."""

    request_id: str

    def apply(self, engine: Engine) -> list[int] | None:
        return engine.held_block_ids(self.request_id)


@dataclass(frozen=True, slots=True)
class ExportHeld(EngineCommand["list[bytes]"]):
    """`Engine.export_held`."""

    request_id: str
    block_ids: Sequence[int]

    def apply(self, engine: Engine) -> list[bytes]:
        return engine.export_held(self.request_id, self.block_ids)


@dataclass(frozen=True, slots=True)
class ReleaseHeld(EngineCommand[bool]):
    """`Engine.release_held`."""

    request_id: str

    def apply(self, engine: Engine) -> bool:
        return engine.release_held(self.request_id)


@dataclass(frozen=True, slots=True)
class ExportDeviceKv(EngineCommand["KvDeviceExport | None"]):
    """`Engine.device_export`."""

    def apply(self, engine: Engine) -> KvDeviceExport | None:
        return engine.device_export()


@dataclass(frozen=True, slots=True)
class NewStagingPool(EngineCommand["StagingPool"]):
    """`Engine.staging_pool`."""

    def apply(self, engine: Engine) -> StagingPool:
        return engine.staging_pool()


@dataclass(frozen=True, slots=True)
class ImportChunk(EngineCommand["tuple[bool, torch.cuda.Event | None]"]):
    """`Engine.import_chunk`."""

    plan: LoadPlan
    first: int
    rows: torch.Tensor
    pool: StagingPool
    device: DeviceRows | None = None

    def apply(self, engine: Engine) -> tuple[bool, torch.cuda.Event | None]:
        return engine.import_chunk(self.plan, self.first, self.rows, self.pool, self.device)


@dataclass(frozen=True, slots=True)
class CopySlots(EngineCommand["torch.cuda.Event"]):
    """`Engine.copy_slots`."""

    pool: StagingPool
    chunk: StagingChunk
    src: torch.Tensor
    slots: Sequence[int]
    nbytes: int
    positions: Sequence[int]

    def apply(self, engine: Engine) -> torch.cuda.Event:
        return engine.copy_slots(self.pool, self.chunk, self.src, self.slots, self.nbytes, self.positions)


@dataclass(frozen=True, slots=True)
class CompleteLoad(EngineCommand[bool]):
    """`Engine.complete_load`."""

    plan: LoadPlan
    num_host_blocks: int = 0

    def apply(self, engine: Engine) -> bool:
        return engine.complete_load(self.plan, self.num_host_blocks)


@dataclass(frozen=True, slots=True)
class FailLoad(EngineCommand[None]):
    """`Engine.fail_load`."""

    request_id: str

    def apply(self, engine: Engine) -> None:
        engine.fail_load(self.request_id)


@dataclass(frozen=True, slots=True)
class PinCached(EngineCommand["CachedPayloads"]):
    """`Engine.pin_cached`."""

    block_hashes: Sequence[bytes]

    def apply(self, engine: Engine) -> CachedPayloads:
        return engine.pin_cached(self.block_hashes)
