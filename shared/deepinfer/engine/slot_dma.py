"""Store slots straight to the device: a same-host shard's shared-memory region registered for DMA, and the copies
of leased slots into a staging chunk's device rows (docs/kvstore.md, "Same host: the shared-memory RAM tier").

    worker thread (once per region)   cudaHostRegister(slots, READ_ONLY | PORTABLE): the read-only mapping's pages
                                      pinned; refused (no read-only registration on this platform, ...) → None:
                                      the reads copy on the CPU as before. cudaHostUnregister before the unmap.
    engine thread (per chunk)         copy_slots: one non_blocking copy per leased slot (a run of adjacent whole
                                      slots: one copy), registered pages → the chunk's device rows, on the
                                      pool's load copy stream; an event the event loop waits for before the
                                      seqlock's second check. The compute stream never waits for these copies:
                                      the import (a scatter on the compute stream) is issued only after that event
                                      completed and the check passed.

Registration runs on its own thread, never the engine thread: pinning every page of a region takes time (tens of
GiB: seconds), and a refused registration leaves its error in that thread's CUDA last-error state, where no later
kernel launch check of the engine thread can mistake it for its own.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.engine.kv_transfer import StagingChunk, StagingPool

log = logging.getLogger(__name__)

#: cudaHostRegister flags: portable (every context) | read-only (the mapping is PROT_READ: the device only reads).
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_READ_ONLY = 0x08
REGISTER_FLAGS = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_READ_ONLY


class RegisteredSlots:
    """A region's slots registered with CUDA: `tensor` [num_slots, slot_bytes] uint8 over the mapping (read-only:
    only ever a copy's source)."""

    def __init__(self, slots: np.ndarray, device: torch.device) -> None:
        self.device = device
        self.ptr, self.nbytes = slots.ctypes.data, slots.nbytes
        with warnings.catch_warnings():  # from_numpy warns about a read-only array: it is only read
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.from_numpy(slots)
        self._slots = slots  # keeps the mapping's view alive as long as the registration
        self.registered = True

    def unregister(self) -> None:
        """cudaHostUnregister (the caller guarantees no copy reads it); RuntimeError when CUDA refuses."""
        if not self.registered:
            return
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostUnregister(self.ptr))
        if code != 0:
            raise RuntimeError(
                f"cudaHostUnregister of {self.nbytes} bytes at {self.ptr:#x}: CUDA error {code}"
            )
        self.registered = False
        del self.tensor, self._slots


class CudaRegistrar:
    """Registers regions with one CUDA device (SharedMemoryReads' RegionRegistrar)."""

    def __init__(self, device: torch.device, flags: int = REGISTER_FLAGS) -> None:
        self.device, self.flags = device, flags

    def register(self, slots: np.ndarray) -> RegisteredSlots | None:
        """Register `slots` (page-aligned, read-only); None, logged, when CUDA refuses. Blocking."""
        if slots.dtype != np.uint8 or slots.ndim != 2 or not slots.flags.c_contiguous or not slots.nbytes:
            raise ValueError(
                f"slots must be a non-empty C-contiguous [num_slots, slot_bytes] uint8 array, got "
                f"{slots.shape} {slots.dtype}"
            )
        ptr = slots.ctypes.data
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, slots.nbytes, self.flags))
        if code != 0:
            log.warning(
                "cudaHostRegister of a %.1f GiB kv region (flags %#x) failed with CUDA error %d: its slots "
                "are copied on the CPU",
                slots.nbytes / (1 << 30),
                self.flags,
                code,
            )
            return None
        return RegisteredSlots(slots, self.device)


def copy_slots(
    pool: StagingPool,
    chunk: StagingChunk,
    src: torch.Tensor,
    slots: Sequence[int],
    nbytes: int,
    positions: Sequence[int],
    device: torch.device,
) -> torch.cuda.Event:
    """Engine thread: copy src[slot, :nbytes] (registered host memory) into chunk.device_rows[position] for each
    pair, non_blocking on the pool's load copy stream; the event after which the rows hold them.

        src  [num_slots, slot_bytes]  ── slot s, first nbytes ──►  device_rows [chunk_blocks, block_nbytes], row p
    """
    if nbytes != pool.block_nbytes or len(slots) != len(positions):
        raise ValueError(
            f"{len(slots)} slots of {nbytes} bytes into {len(positions)} rows of {pool.block_nbytes}"
        )
    rows = pool.device_rows(chunk, device)
    stream = pool.copy_stream(device)
    whole = nbytes == src.shape[1]  # adjacent slots are one contiguous run of the region
    with torch.cuda.stream(stream):
        try:
            for position, slot, count in _runs(positions, slots, whole):
                rows[position : position + count].copy_(src[slot : slot + count, :nbytes], non_blocking=True)
        except BaseException:
            stream.synchronize()  # no copy of this call may land in the rows after the caller gave up on them
            raise
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _runs(positions: Sequence[int], slots: Sequence[int], merge: bool) -> list[tuple[int, int, int]]:
    """(first position, first slot, count) of each run where both advance by one (none merged unless `merge`)."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in zip(positions, slots, strict=True):
        if merge and runs and runs[-1][0] + runs[-1][2] == position and runs[-1][1] + runs[-1][2] == slot:
            first_position, first_slot, count = runs[-1]
            runs[-1] = (first_position, first_slot, count + 1)
        else:
            runs.append((position, slot, 1))
    return runs
