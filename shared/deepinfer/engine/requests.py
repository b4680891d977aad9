"""What enters the engine: an `EngineRequest`, whose KV source says where its prompt's KV comes from, and the
`Admission` that says what the engine did with it.

    kv source          where the prompt's KV comes from                          admission
    ComputeKv          computed here (the device prefix cache and the host        queued
                       tier's hits reused)
    PulledKv           payloads pulled from a prefill worker over the data        "pulled", or "computed" when
                       plane, every block of the prompt in token order           no block is free right now
    PeerDeviceKv       the owner's device cache on this host (CUDA IPC): its      "device" with the copy's event,
                       leased block ids copied device to device                  or "computed" (no free block)
    StoredKv           the kvcache store holds the first num_blocks full blocks   "loading" with the plan to fetch
                       (the worker fetches them, the engine imports them)         and import, or "computed"

A request that cannot be admitted as asked (no free block for pulled KV, the device already holds the stored
prefix) is computed here instead: the caller never needs a second call. So is every request asking for
prompt_logprobs, whatever its source: their logits exist only where the prompt is computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from deepinfer.protocol.kv import KvDeviceExport


@dataclass(frozen=True, slots=True)
class ComputeKv:
    """The prompt is computed here."""


@dataclass(frozen=True, slots=True)
class PulledKv:
    """The prompt's KV, pulled from its prefill worker: one payload per block covering the prompt (the last may be
    partial), in token order. Blocks already in this engine's prefix cache are reused and their payloads skipped."""

    payloads: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class PeerDeviceKv:
    """The prompt's KV in a same-host owner's device cache (its CUDA IPC export): `block_ids` of that cache cover
    the prompt in token order. `DeviceTransferError` when the export cannot be mapped here (use the data plane)."""

    export: KvDeviceExport
    block_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class StoredKv:
    """The kvcache store holds the prompt's first `num_blocks` full blocks (`block_hashes`: the hashes of every full
    block of prompt + output tokens, as `deepinfer.hashing.hash_blocks` gives them)."""

    num_blocks: int
    block_hashes: Sequence[bytes]


KvSource = ComputeKv | PulledKv | PeerDeviceKv | StoredKv

#: The default source: compute the prompt.
COMPUTE = ComputeKv()


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request for the engine: its tokens, how to sample, and where its prompt's KV comes from."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    #: Separates the prefix cache between tenants (part of every block hash).
    cache_salt: str = ""
    #: Tokens already generated elsewhere (a resumed or re-prefilled request): recomputed with the prompt.
    output_token_ids: Sequence[int] = ()
    #: Keep the KV blocks referenced after the request finishes: a prefill worker's lease, read by
    #: `Engine.export_held` and ended by `Engine.release_held`.
    hold_blocks: bool = False
    kv: KvSource = COMPUTE


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Which blocks a loading request waits for: its block_hashes[first_block : first_block + len(block_ids)]."""

    request_id: str
    first_block: int
    block_ids: list[int]


@dataclass(frozen=True)
class Admission:
    """What `Engine.add_request` did with a request."""

    #: How its KV arrives: "computed" (queued to compute, prefix hits reused), "pulled", "device", "loading".
    kv: str
    #: "loading": the store blocks to fetch and import (`Engine.import_chunk`, then `complete_load` or
    #: `fail_load`), and the payloads of those the host tier holds (None: fetch from the store).
    load: LoadPlan | None = None
    local_payloads: list[bytes | None] = field(default_factory=list)
    #: "device": the owner's blocks may be reused once this event has completed (`wait_copied`).
    copied: torch.cuda.Event | None = None

    def wait_copied(self) -> None:
        """Block until the owner's blocks have been read (call off the engine thread; releases the GIL)."""
        if self.copied is not None:
            self.copied.synchronize()
