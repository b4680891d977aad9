"""The engine: one model on one device (or tensor-parallel group), stepped by continuous batching.

Services, `deepinfer.worker` and `LLM` use it through the names below only (the layer test checks that no service
or worker module imports a submodule): `Engine` is the front door (add a request, whose KV source is a field of
the request; step; abort; stats; KV events and snapshots; leases and store loads), `EngineCommand`s are how work
reaches it from another thread. Everything else here (scheduler, block pool, runner, graphs) is its inside.

`import deepinfer.engine` stays light: a name loads its module (and torch) on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "Engine": "engine",
    "EngineArgs": "args",
    "EngineRequest": "requests",
    "COMPUTE": "requests",
    "ComputeKv": "requests",
    "PulledKv": "requests",
    "PeerDeviceKv": "requests",
    "StoredKv": "requests",
    "KvSource": "requests",
    "Admission": "requests",
    "LoadPlan": "requests",
    "EngineCommand": "commands",
    "AddRequest": "commands",
    "Abort": "commands",
    "HeldBlockIds": "commands",
    "ExportHeld": "commands",
    "ReleaseHeld": "commands",
    "ExportDeviceKv": "commands",
    "NewStagingPool": "commands",
    "ImportChunk": "commands",
    "CopySlots": "commands",
    "CompleteLoad": "commands",
    "FailLoad": "commands",
    "PinCached": "commands",
    "EngineOutput": "outputs",
    "EngineStats": "outputs",
    "SampledToken": "outputs",
    "PromptLogprobs": "outputs",
    "KvCacheEvent": "block_pool",
    "Stored": "block_pool",
    "Removed": "block_pool",
    "AllCleared": "block_pool",
    "DEVICE_TIER": "block_pool",
    "HOST_TIER": "host_pool",
    "HostTierReport": "host_tier",
    "ContextLengthExceeded": "errors",
    "LeaseNotHeld": "handoff",
    "DeviceTransferError": "kv_device_transfer",
    "host_id": "kv_device_transfer",
    "CachedPayloads": "kv_load",
    "StagingPool": "kv_transfer",
    "StagingChunk": "kv_transfer",
    "CudaRegistrar": "slot_dma",
    "RegisteredSlots": "slot_dma",
    "DeviceRows": "kv_transfer",
    "block_nbytes": "kv_transfer",
    "ExecutionMode": "execution",
    "StartPhase": "start_progress",
    "StartProgress": "start_progress",
    "SpeculativeConfig": "spec_config",
    "SpecDecodeStats": "spec_decode_stats",
}

__all__ = [
    "COMPUTE",
    "Abort",
    "AddRequest",
    "Admission",
    "AllCleared",
    "CachedPayloads",
    "CompleteLoad",
    "ComputeKv",
    "ContextLengthExceeded",
    "CopySlots",
    "CudaRegistrar",
    "DEVICE_TIER",
    "DeviceRows",
    "DeviceTransferError",
    "Engine",
    "EngineArgs",
    "EngineCommand",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "ExecutionMode",
    "ExportDeviceKv",
    "ExportHeld",
    "FailLoad",
    "HOST_TIER",
    "HeldBlockIds",
    "HostTierReport",
    "ImportChunk",
    "KvCacheEvent",
    "KvSource",
    "LeaseNotHeld",
    "LoadPlan",
    "NewStagingPool",
    "PeerDeviceKv",
    "PinCached",
    "PromptLogprobs",
    "PulledKv",
    "RegisteredSlots",
    "ReleaseHeld",
    "Removed",
    "SampledToken",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "StagingChunk",
    "StagingPool",
    "StartPhase",
    "StartProgress",
    "Stored",
    "StoredKv",
    "block_nbytes",
    "host_id",
]

if TYPE_CHECKING:
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.block_pool import DEVICE_TIER, AllCleared, KvCacheEvent, Removed, Stored
    from deepinfer.engine.commands import (
        Abort,
        AddRequest,
        CompleteLoad,
        CopySlots,
        EngineCommand,
        ExportDeviceKv,
        ExportHeld,
        FailLoad,
        HeldBlockIds,
        ImportChunk,
        NewStagingPool,
        PinCached,
        ReleaseHeld,
    )
    from deepinfer.engine.engine import Engine
    from deepinfer.engine.errors import ContextLengthExceeded
    from deepinfer.engine.execution import ExecutionMode
    from deepinfer.engine.handoff import LeaseNotHeld
    from deepinfer.engine.host_pool import HOST_TIER
    from deepinfer.engine.host_tier import HostTierReport
    from deepinfer.engine.kv_device_transfer import DeviceTransferError, host_id
    from deepinfer.engine.kv_load import CachedPayloads
    from deepinfer.engine.kv_transfer import DeviceRows, StagingChunk, StagingPool, block_nbytes
    from deepinfer.engine.outputs import EngineOutput, EngineStats, PromptLogprobs, SampledToken
    from deepinfer.engine.requests import (
        COMPUTE,
        Admission,
        ComputeKv,
        EngineRequest,
        KvSource,
        LoadPlan,
        PeerDeviceKv,
        PulledKv,
        StoredKv,
    )
    from deepinfer.engine.slot_dma import CudaRegistrar, RegisteredSlots
    from deepinfer.engine.spec_config import SpeculativeConfig
    from deepinfer.engine.spec_decode_stats import SpecDecodeStats
    from deepinfer.engine.start_progress import StartPhase, StartProgress

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"deepinfer.engine.{module}"), name)
    globals()[name] = value
    return value
