"""`HostStaging`: reusable host memory for a step's small host→device copies (sampling metadata, index lists).

A caller writes one step's values into `acquire(nbytes)` (a numpy view), then `upload(nbytes)` gives them on the
device as a uint8 tensor of its own, which the caller views as the dtypes it wrote. On CUDA the slots are pinned
and the copy is non_blocking; the slots form a ring, each with the event of its last copy, so a write waits only
for the copy made `num_slots` uploads earlier (long landed), never for the step in flight. On the CPU the same
ring is plain memory, there is no event, and `upload` returns a copy, so a later write never changes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Slots in a ring: a step acquires one or two, so four keep every write clear of the previous step's copies.
DEFAULT_NUM_SLOTS = 4
_MIN_SLOT_BYTES = 4096


class HostStaging:
    """A ring of host byte buffers (pinned on CUDA), grown on demand, each reused once its last copy has left it."""

    def __init__(self, device: torch.device | str, num_slots: int = DEFAULT_NUM_SLOTS) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host = [torch.empty(0, dtype=torch.uint8) for _ in range(num_slots)]
        self._views: list[np.ndarray] = [h.numpy() for h in self._host]
        self._copied: list[torch.cuda.Event | None] = [None] * num_slots
        self._slot = num_slots - 1  # the slot acquired last

    def acquire(self, nbytes: int) -> np.ndarray:
        """The next slot's first `nbytes`, as uint8, to write this step's values into (waits for its last copy)."""
        slot = self._slot = (self._slot + 1) % len(self._host)
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()  # the copy made num_slots uploads ago has left this slot
        if nbytes > self._host[slot].numel():
            size = max(_MIN_SLOT_BYTES, 2 * nbytes)
            self._host[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self._views[slot] = self._host[slot].numpy()
        return self._views[slot][:nbytes]

    def upload(self, nbytes: int) -> torch.Tensor:
        """The acquired slot's first `nbytes` on the device: a uint8 tensor [nbytes] that no later write touches."""
        slot = self._slot
        host = self._host[slot][:nbytes]
        if not self.pinned:
            return host.clone()
        device_bytes = host.to(self.device, non_blocking=True)
        copied = self._copied[slot]
        if copied is None:
            copied = self._copied[slot] = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
        return device_bytes

    def int64_rows(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Equal-length int lists as one int64 tensor [len(rows), n] on the device (one copy)."""
        num_rows, n = len(rows), len(rows[0]) if rows else 0
        nbytes = 8 * num_rows * n
        host = self.acquire(nbytes).view(np.int64).reshape(num_rows, n)
        for i, values in enumerate(rows):
            host[i] = values
        return self.upload(nbytes).view(torch.int64).view(num_rows, n)

    def int64_lists(self, lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
        """Int lists of any lengths as int64 tensors on the device: views of one upload, one per list."""
        sizes = [len(values) for values in lists]
        nbytes = 8 * sum(sizes)
        host, start = self.acquire(nbytes).view(np.int64), 0
        for values, size in zip(lists, sizes, strict=True):
            host[start : start + size] = values
            start += size
        return self.upload(nbytes).view(torch.int64).split(sizes)
