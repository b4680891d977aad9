"""The runner's half of async scheduling: sampled ids stay on the device for the next step's inputs, and come
back to the host through pinned memory without stalling the next launch.

    step N      forward → sample → token_ids [S] ──index_copy──► SampledTokenBuffer.token_ids [rows]
                                        └──non_blocking copy──► pinned host + event      (PendingSample, into a
                                                                 reused SampleLanding slot)
    step N+1    input_ids[placeholder_indices] = SampledTokenBuffer.token_ids[placeholder_rows]   (on device)

The index lists (placeholder indices, their rows, the rows step N+1 samples into) reach the device with the CUDA
graph's static inputs (`cuda_graphs.StagedIndices`), or eagerly in one staging upload (`fill`).

Rows are the requests' block-table rows: a request keeps its row while it runs, so the row it sampled into at
step N is the row step N+1 reads (a request that stopped or was preempted in between takes no placeholder).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.outputs import SampledToken
from deepinfer.sampling.staging import HostStaging

if TYPE_CHECKING:
    from deepinfer.engine.request import Request
    from deepinfer.sampling.sampler import SamplerOutput


class SampledTokenBuffer:
    """The last sampled token id of each block-table row, on the device; fills placeholder inputs from it."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.device = device
        self.token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows]
        self._staging = HostStaging(device)

    def _ensure_rows(self, num_rows: int) -> None:
        if num_rows > self.token_ids.numel():  # the block table grew its rows
            grown = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
            grown[: self.token_ids.numel()] = self.token_ids
            self.token_ids = grown

    def fill(
        self,
        input_ids: torch.Tensor,
        placeholder_indices: Sequence[int],
        rows: Sequence[int],
        sampled_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """input_ids[placeholder_indices] = the last token sampled in `rows`, on the device (no host sync).

        `sampled_rows` (the rows this step's record() writes) travel in the same copy: returned on the device.
        """
        indices, read, sampled = self._staging.int64_lists((placeholder_indices, rows, sampled_rows))
        self.fill_staged(input_ids, indices, read)
        return sampled

    def fill_staged(self, input_ids: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> None:
        """fill() with its index lists already on the device (the CUDA graph's static buffer holds them)."""
        input_ids.index_copy_(0, indices, self.token_ids.index_select(0, rows))

    def record(self, rows: Sequence[int] | torch.Tensor, token_ids: torch.Tensor, num_rows: int) -> None:
        """Remember a step's sampled ids [S] under the sampled requests' rows (host ints, or the device index
        fill() returned); `num_rows`: the table's rows."""
        self._ensure_rows(num_rows)
        index = rows if isinstance(rows, torch.Tensor) else self._staging.int64_lists((rows,))[0]
        self.token_ids.index_copy_(0, index, token_ids)


class SampleLanding:
    """Reused host memory (pinned on CUDA) that a step's sampled tensors land in, instead of a pinned allocation
    per tensor per step: a ring of `num_slots` steps, each with its buffers and the event of its copies.

    A slot is written again `num_slots` launches later. The engine reads a step's tokens (`PendingSample.result`)
    before it launches the step after next, so two slots would do; a PendingSample read too late raises.
    """

    def __init__(self, pinned: bool, num_slots: int = 3) -> None:
        self.pinned = pinned
        self._buffers: list[list[torch.Tensor | None]] = [[None] * 4 for _ in range(num_slots)]
        self._events: list[torch.cuda.Event | None] = [None] * num_slots
        #: Launches that wrote each slot, so a PendingSample can tell whether its slot was written since.
        self.generations = [0] * num_slots
        self._slot = num_slots - 1

    def land(self, tensors: Sequence[torch.Tensor | None]) -> tuple[int, int, list[torch.Tensor | None]]:
        """Queue non_blocking copies of `tensors` into the next slot: (slot, its generation, host views)."""
        slot = self._slot = (self._slot + 1) % len(self._buffers)
        self.generations[slot] += 1
        buffers, host = self._buffers[slot], []
        for i, t in enumerate(tensors):
            if t is None:
                host.append(None)
                continue
            buffer, numel = buffers[i], t.numel()
            if buffer is None or buffer.dtype != t.dtype or buffer.numel() < numel:
                buffer = buffers[i] = torch.empty(max(2 * numel, 64), dtype=t.dtype, pin_memory=self.pinned)
            view = buffer[:numel].view(t.shape)
            view.copy_(t, non_blocking=self.pinned)
            host.append(view)
        if self.pinned:
            event = self._events[slot]
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record()
        return slot, self.generations[slot], host

    def wait(self, slot: int, generation: int) -> None:
        """Block until the slot's copies have landed; RuntimeError when a later launch reused the slot."""
        if self.generations[slot] != generation:
            raise RuntimeError("sampled tokens read after their host slot was reused (more than one step unread)")
        event = self._events[slot]
        if event is not None:
            event.synchronize()


class PendingSample:
    """A launched step's sampled tokens on their way to the host; `result()` waits only for that step.

    `needs_sync`: the next step's sampling reads these tokens on the host side (penalties over the output
    tokens), so the engine must update with them before scheduling the next step. `landing`: where the tensors
    are copied (the CUDA case); without it the tensors are read as they are (the CPU case).
    """

    def __init__(
        self,
        out: SamplerOutput | None,
        chosen: list[Request],
        needs_sync: bool = False,
        landing: SampleLanding | None = None,
    ) -> None:
        self.chosen = chosen
        self.needs_sync = needs_sync
        self._landing = landing
        self._slot = self._generation = 0
        self._host: list[torch.Tensor | None] = []
        if out is None:
            return
        tensors = [out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs]
        if landing is not None:
            self._slot, self._generation, self._host = landing.land(tensors)
        else:
            self._host = tensors

    def result(self) -> dict[str, SampledToken]:
        """request_id → its sampled token (with logprobs), once the copy has landed."""
        if not self._host:
            return {}
        if self._landing is not None:
            self._landing.wait(self._slot, self._generation)
        return sampled_tokens(self.chosen, *(None if t is None else t.tolist() for t in self._host))


def sampled_tokens(
    chosen: Sequence[Request],
    token_ids: list[int],
    logprobs: list[float],
    top_ids: list[list[int]] | None,
    top_logprobs: list[list[float]] | None,
) -> dict[str, SampledToken]:
    """request_id → SampledToken from one step's host lists (row i = chosen[i]; top-k cut to what it asked)."""
    if top_ids is None:  # no row asked for top logprobs
        return {r.request_id: SampledToken(t, lp) for r, t, lp in zip(chosen, token_ids, logprobs, strict=True)}
    result: dict[str, SampledToken] = {}
    for i, request in enumerate(chosen):
        k = request.sampling_params.logprobs
        top = None
        if k and top_ids is not None:
            top = list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True))
        result[request.request_id] = SampledToken(token_ids[i], logprobs[i], top)
    return result
