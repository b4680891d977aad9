"""The runner's half of async scheduling: sampled ids stay on the device for the next step's inputs, and come
back to the host through pinned memory without stalling the next launch.

    step N      forward → sample → token_ids [S] ──index_copy──► SampledTokenBuffer.token_ids [rows]
                                        └──non_blocking copy──► pinned host + event      (PendingSample)
    step N+1    input_ids[placeholder_indices] = SampledTokenBuffer.token_ids[placeholder_rows]   (on device)

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
        input_ids.index_copy_(0, indices, self.token_ids.index_select(0, read))
        return sampled

    def record(self, rows: Sequence[int] | torch.Tensor, token_ids: torch.Tensor, num_rows: int) -> None:
        """Remember a step's sampled ids [S] under the sampled requests' rows (host ints, or the device index
        fill() returned); `num_rows`: the table's rows."""
        self._ensure_rows(num_rows)
        index = rows if isinstance(rows, torch.Tensor) else self._staging.int64_lists((rows,))[0]
        self.token_ids.index_copy_(0, index, token_ids)


class PendingSample:
    """A launched step's sampled tokens on their way to the host; `result()` waits only for that step.

    `needs_sync`: the next step's sampling reads these tokens on the host side (penalties over the output
    tokens), so the engine must update with them before scheduling the next step.
    """

    def __init__(self, out: SamplerOutput | None, chosen: list[Request], needs_sync: bool = False) -> None:
        self.chosen = chosen
        self.needs_sync = needs_sync
        self._event: torch.cuda.Event | None = None
        self._host: list[torch.Tensor | None] = []
        if out is None:
            return
        tensors = [out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs]
        if out.token_ids.device.type == "cuda":
            self._host = [None if t is None else _to_pinned(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def result(self) -> dict[str, SampledToken]:
        """request_id → its sampled token (with logprobs), once the copy has landed."""
        if not self._host:
            return {}
        if self._event is not None:
            self._event.synchronize()
        return sampled_tokens(self.chosen, *(None if t is None else t.tolist() for t in self._host))


def sampled_tokens(
    chosen: Sequence[Request],
    token_ids: list[int],
    logprobs: list[float],
    top_ids: list[list[int]] | None,
    top_logprobs: list[list[float]] | None,
) -> dict[str, SampledToken]:
    """request_id → SampledToken from one step's host lists (row i = chosen[i]; top-k cut to what it asked)."""
    result: dict[str, SampledToken] = {}
    for i, request in enumerate(chosen):
        k = request.sampling_params.logprobs
        top = None
        if k and top_ids is not None:
            top = list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True))
        result[request.request_id] = SampledToken(token_ids[i], logprobs[i], top)
    return result


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
