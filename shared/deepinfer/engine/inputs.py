"""The runner's host-side inputs: the persistent block table, one step's flat batch and its staging to the device.

The scheduler sends each request's block ids once (`is_new`) and afterwards only the ids appended since its
last step, so the runner keeps the tables here, one row per running request:

    BlockTable.table  int32 [rows, max_blocks_per_seq]   row 0 = the null row (all block 0: padding rows read it)
    row r             | b0 b1 b2 ... b_{n-1} | 0 0 ... |   the first n = len(block_ids[r]) entries are live

A step's [B, W] block table is a gather of its requests' rows (one numpy take), copied with the other inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.prompt_logprobs import PromptRows, prompt_rows
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledRequest
from deepinfer.kernels.metadata import AttentionMetadata

#: Staging segments start on multiples of this many elements, so every device view is 64-byte aligned.
_ALIGN = 16
#: The row of the block table that stays all zeros (block 0 is the reserved null block).
NULL_ROW = 0


class BlockTable:
    """Host block tables of the running requests, one reused row each; rows grow when more are needed."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((max_num_seqs + 1, max(1, max_blocks_per_seq)), dtype=np.int32)
        #: Python mirror of each row's live ids (list indexing is what slot arithmetic needs, and it is fast).
        self.block_ids: list[list[int]] = [[] for _ in range(max_num_seqs + 1)]
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs, 0, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the table."""
        return self.table.shape[1]

    @property
    def num_free_rows(self) -> int:
        """Rows not assigned to a request."""
        return len(self._free_rows)

    def update(self, scheduled: ScheduledRequest) -> int:
        """Apply one scheduled request's block ids (whole table when is_new, else appended ids); its row."""
        new_ids = scheduled.new_block_ids
        if scheduled.is_new:
            row = self.rows.get(scheduled.request_id)
            if row is None:
                row = self._free_rows.pop() if self._free_rows else self._grow_rows()
                self.rows[scheduled.request_id] = row
            self.block_ids[row] = list(new_ids)
            self.table[row] = 0  # padded with the null block, as build_attention_metadata pads
            self._write(row, 0, new_ids)
            return row
        row = self.rows[scheduled.request_id]
        if new_ids:
            ids = self.block_ids[row]
            self._write(row, len(ids), new_ids)
            ids.extend(new_ids)
        return row

    def free(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of finished or preempted requests (unknown ids are ignored)."""
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.block_ids[row] = []
                self._free_rows.append(row)

    def free_stale(self, is_live: Callable[[str], bool]) -> None:
        """Give back every row whose request is no longer running (when no list of finished ids was given)."""
        self.free([request_id for request_id in self.rows if not is_live(request_id)])

    def gather(self, rows: Sequence[int], width: int, out: np.ndarray) -> None:
        """out [len(rows), width] = the first `width` columns of `rows` (columns past a row's blocks are stale)."""
        np.take(self.table[:, :width], rows, axis=0, out=out)

    def _write(self, row: int, start: int, ids: Sequence[int]) -> None:
        end = start + len(ids)
        if end > self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, max(end, 2 * self.table.shape[1]) - self.table.shape[1])))
        self.table[row, start:end] = ids

    def _grow_rows(self) -> int:
        num_rows = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.block_ids += [[] for _ in range(num_rows)]
        self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()


@dataclass
class ModelInputs:
    """The flat batch of one step, on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: row of the last token of each sampled request
    sampled: list[ScheduledRequest]


@dataclass
class HostBatch:
    """One step's flat batch as host ints, before any device copy (see deepinfer.engine.runner for the layout)."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    slot_mapping: list[int] = field(default_factory=list)  # [T]: block_id * block_size + offset; -1 = padding
    query_lens: list[int] = field(default_factory=list)  # [B]
    seq_lens: list[int] = field(default_factory=list)  # [B]: context incl. this step's tokens
    block_table_rows: list[int] = field(default_factory=list)  # [B]: row of each sequence in the BlockTable
    logits_indices: list[int] = field(default_factory=list)  # [S]: row of each sampled request's last token
    sampled: list[ScheduledRequest] = field(default_factory=list)  # [S]
    sampled_rows: list[int] = field(default_factory=list)  # [S]: block-table row of each sampled request
    #: Longest block list among the sequences (the width of the step's block table).
    max_num_blocks: int = 0
    #: Async scheduling: rows of input_ids whose token the previous step sampled and the host has not seen yet
    #: (fed as 0 here; the runner fills them on the device), and the block-table row of each one's request.
    placeholder_indices: list[int] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)
    #: Prompt logprobs: rows whose logits score the request's next prompt token, and whose they are
    #: (deepinfer.engine.prompt_logprobs); empty unless a request in the step asked for them.
    prompt_logits_indices: list[int] = field(default_factory=list)  # [R]
    prompt_rows: list[PromptRows] = field(default_factory=list)
    #: Speculative decoding: draft tokens fed by the step's sequences. A sampled sequence with k drafts has k + 1
    #: entries in logits_indices (its last k + 1 rows, verified together), one entry in `sampled`.
    num_draft_tokens: int = 0
    #: KV groups (`group_slots`): each group's slot mapping [T]; `slot_mapping` is then group 0's.
    group_slot_mappings: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Rows T of the flat batch."""
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences B in the batch."""
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence feeds exactly one token (the shape CUDA graphs are captured for)."""
        return self.num_tokens == self.num_seqs


def block_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1: one Python step per block, not per token."""
    slots: list[int] = []
    position = start
    while position < end:
        offset = position % block_size
        stop = min(end, position - offset + block_size)
        base = block_ids[position // block_size] * block_size
        slots.extend(range(base + offset, base + offset + stop - position))
        position = stop
    return slots


def build_host_batch(
    scheduled: Sequence[ScheduledRequest],
    block_table: BlockTable,
    block_size: int,
    requests: Mapping[str, Request] | None = None,
) -> HostBatch:
    """Apply the requests' new block ids to `block_table` and flatten them into host lists (no tensors). With
    `requests`, the rows that score prompt tokens for prompt logprobs are listed too."""
    batch = HostBatch()
    input_ids = batch.input_ids
    # Bound appends: a decode row appends to eight lists, and every step has a row per running request.
    add_position, add_slot, add_query_len = batch.positions.append, batch.slot_mapping.append, batch.query_lens.append
    add_seq_len, add_table_row = batch.seq_lens.append, batch.block_table_rows.append
    add_logits_index, add_sampled, add_sampled_row = (batch.logits_indices.append, batch.sampled.append,
                                                      batch.sampled_rows.append)
    add_placeholder_index, add_placeholder_row = batch.placeholder_indices.append, batch.placeholder_rows.append
    update, rows, all_block_ids, max_num_blocks = block_table.update, block_table.rows, block_table.block_ids, 0
    for s in scheduled:
        # A running request without new blocks keeps its row as it is (update()'s every-step case, inline).
        row = update(s) if s.is_new or s.new_block_ids else rows[s.request_id]
        block_ids = all_block_ids[row]
        start, num_new, token_ids = s.num_computed_tokens, s.num_new_tokens, s.token_ids
        input_ids += token_ids
        if len(token_ids) < num_new:  # an output placeholder: the last token, sampled by the step in flight
            assert len(token_ids) == num_new - 1, (s.request_id, len(token_ids), num_new)
            add_placeholder_index(len(input_ids))
            add_placeholder_row(row)
            input_ids.append(0)
        if num_new == 1:
            add_position(start)
            add_slot(block_ids[start // block_size] * block_size + start % block_size)
        else:
            batch.positions.extend(range(start, start + num_new))
            batch.slot_mapping.extend(block_slots(block_ids, start, start + num_new, block_size))
        add_query_len(num_new)
        add_seq_len(start + num_new)
        add_table_row(row)
        if len(block_ids) > max_num_blocks:
            max_num_blocks = len(block_ids)
        if s.sample:
            num_drafts = s.num_draft_tokens
            if num_drafts:  # the last token's row and each draft's: k + 1 rows to verify
                batch.logits_indices.extend(range(len(input_ids) - 1 - num_drafts, len(input_ids)))
                batch.num_draft_tokens += num_drafts
            else:
                add_logits_index(len(input_ids) - 1)
            add_sampled(s)
            add_sampled_row(row)
    batch.max_num_blocks = max_num_blocks
    # Only a prompt chunk scores prompt tokens: a step of sampled one-token rows (every decode step) skips this.
    if requests is not None and (len(input_ids) > len(batch.seq_lens) or len(batch.sampled) < len(batch.seq_lens)):
        _add_prompt_rows(batch, scheduled, requests)
    return batch


def group_slots(batch: HostBatch, scheduled: Sequence[ScheduledRequest], block_table: BlockTable, block_size: int,
                num_groups: int) -> None:
    """With KV groups a table row holds every group's block ids interleaved (block i of group g at column
    i * num_groups + g: HybridKVCacheManager.block_ids_from); set each group's slot mapping on the batch that
    build_host_batch made from those rows (its own `slot_mapping`, read as one table, is replaced by group 0's)."""
    rows, all_block_ids = block_table.rows, block_table.block_ids
    mappings: list[list[int]] = [[] for _ in range(num_groups)]
    for s in scheduled:
        block_ids = all_block_ids[rows[s.request_id]]
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for g, mapping in enumerate(mappings):
            mapping.extend(block_slots(block_ids[g::num_groups], start, end, block_size))
    batch.group_slot_mappings = mappings
    batch.slot_mapping = mappings[0]


def _add_prompt_rows(batch: HostBatch, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]) -> None:
    """List the rows of the batch that score their request's prompt tokens (deepinfer.engine.prompt_logprobs)."""
    offset = 0  # the flat row of each request's first token
    for s in scheduled:
        num_new = s.num_new_tokens
        request = requests.get(s.request_id) if num_new > 1 or not s.sample else None  # a decode row scores none
        rows = None if request is None else prompt_rows(request, s.num_computed_tokens, num_new)
        if rows is not None:
            first_row = offset + rows.first - 1 - s.num_computed_tokens  # the row at position first - 1
            batch.prompt_logits_indices.extend(range(first_row, first_row + rows.num_rows))
            batch.prompt_rows.append(rows)
        offset += num_new


def pad_decode_batch(batch: HostBatch, num_seqs: int) -> HostBatch:
    """A decode-only batch grown to `num_seqs` rows: padding rows feed token 0 at position 0, write no KV
    (slot -1) and attend to one key in the reserved null block 0 (seq_len 1, the null row), so every row stays
    finite."""
    assert batch.is_decode_only and num_seqs >= batch.num_seqs, (batch.num_tokens, batch.num_seqs, num_seqs)
    num_pad = num_seqs - batch.num_seqs
    return HostBatch(
        input_ids=batch.input_ids + [0] * num_pad,
        positions=batch.positions + [0] * num_pad,
        slot_mapping=batch.slot_mapping + [-1] * num_pad,
        query_lens=batch.query_lens + [1] * num_pad,
        seq_lens=batch.seq_lens + [1] * num_pad,
        block_table_rows=batch.block_table_rows + [NULL_ROW] * num_pad,
        logits_indices=batch.logits_indices,
        sampled=batch.sampled,
        sampled_rows=batch.sampled_rows,
        max_num_blocks=max(batch.max_num_blocks, 1),
        placeholder_indices=batch.placeholder_indices,
        placeholder_rows=batch.placeholder_rows,
        prompt_logits_indices=batch.prompt_logits_indices,
        prompt_rows=batch.prompt_rows,
    )


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class InputStager:
    """Host→device transfer of a step's batch: ints written into one pinned int64 and one pinned int32 buffer,
    then one non_blocking copy each. The buffers are reused, so each write first waits for the previous copy.

    Layout (segments aligned to 16 elements):  int64 | input_ids T | positions T | slot_mapping T | logits S |
                                               int32 | query_start_loc B+1 | seq_lens B | block_tables B x W |
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host64 = self._dev64 = torch.empty(0, dtype=torch.int64)
        self._host32 = self._dev32 = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event() if self._pinned else None

    def _ensure(self, num64: int, num32: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffers
        if num64 > self._host64.numel():
            self._host64, self._dev64 = self._alloc(2 * num64, torch.int64)
        if num32 > self._host32.numel():
            self._host32, self._dev32 = self._alloc(2 * num32, torch.int32)

    def _alloc(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.zeros(numel, dtype=dtype, pin_memory=self._pinned)
        return host, (torch.empty(numel, dtype=dtype, device=self.device) if self._pinned else host)

    def stage(self, batch: HostBatch, block_table: BlockTable) -> ModelInputs:
        """Copy the batch to the device and return its tensors (views of the device buffers)."""
        num_tokens, num_seqs, num_sampled = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
        width = batch.max_num_blocks or 1
        t, s = _aligned(num_tokens), _aligned(num_sampled)
        b1, b = _aligned(num_seqs + 1), _aligned(num_seqs)
        self._ensure(3 * t + s, b1 + b + num_seqs * width)
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        h64[:num_tokens] = batch.input_ids
        h64[t : t + num_tokens] = batch.positions
        h64[2 * t : 2 * t + num_tokens] = batch.slot_mapping
        h64[3 * t : 3 * t + num_sampled] = batch.logits_indices
        query_start_loc = np.cumsum([0, *batch.query_lens])
        h32[: num_seqs + 1] = query_start_loc
        h32[b1 : b1 + num_seqs] = batch.seq_lens
        block_table.gather(batch.block_table_rows, width, h32[b1 + b : b1 + b + num_seqs * width].reshape(-1, width))
        d64, d32 = self._dev64, self._dev32
        if self._pinned:
            d64[: 3 * t + s].copy_(self._host64[: 3 * t + s], non_blocking=True)
            n32 = b1 + b + num_seqs * width
            d32[:n32].copy_(self._host32[:n32], non_blocking=True)
            self._copied.record()
        meta = AttentionMetadata(
            query_start_loc=d32[: num_seqs + 1],
            seq_lens=d32[b1 : b1 + num_seqs],
            block_tables=d32[b1 + b : b1 + b + num_seqs * width].view(num_seqs, width),
            slot_mapping=d64[2 * t : 2 * t + num_tokens],
            max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=list(batch.seq_lens),
            num_decodes=batch.query_lens.count(1),
        )
        return ModelInputs(
            input_ids=d64[:num_tokens],
            positions=d64[t : t + num_tokens],
            meta=meta,
            logits_indices=d64[3 * t : 3 * t + num_sampled],
            sampled=batch.sampled,
        )
