"""Per-step attention metadata of a ragged batch: what every attention kernel reads besides q/k/v."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its context sits in the paged cache.

    A ragged batch flattens the scheduled tokens of B sequences into T rows:

        rows     | seq 0: q_len 5 (prefill) | seq 1: q_len 1 (decode) | seq 2: q_len 3 (prefill over prefix) |
        query_start_loc = [0, 5, 6, 9]      seq_lens = [5, 40, 19]

    Token i of sequence b (0 <= i < q_len_b) sits at absolute position seq_len_b - q_len_b + i and attends
    causally to keys at positions 0..that position, all read from the paged cache.
    """

    query_start_loc: torch.Tensor  # [B+1] int32 on device
    seq_lens: torch.Tensor  # [B] int32 on device: context length incl. this step's new tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 on device, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset; < 0 = padding
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies: the torch twin needs no device->host sync
    seq_lens_cpu: list[int]
    #: Sequences with exactly one new row (decodes, or a prompt's last token over a cached prefix); a mixed
    #: step sends them to the decode kernel. None = not counted: the batch takes one kernel.
    num_decodes: int | None = None
    #: Graph mode (kernels.triton_graph_attention): [1 + 2 * capacity] int32 on device, the step's prefill tiles;
    #: the device tensors above are then static buffers padded to the bucket. None: the eager launches.
    prefill_tiles: torch.Tensor | None = None
    #: Work of one step that a kernel would otherwise redo in every layer (every layer reads the same tables),
    #: by the kernel's key: the CPU attention's gather indices (kernels.sdpa_paged). Filled by the first layer.
    layer_shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    #: KV by layer type (engine/kv_groups.py): each layer's own metadata (its group's block tables and slot
    #: mapping), which the decoder stack hands that layer; None = this one for every layer.
    layer_metas: list[AttentionMetadata] | None = field(default=None, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        """Number of sequences B in the batch."""
        return len(self.seq_lens_cpu)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slot_mapping: Sequence[int],
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host lists (block tables are padded with 0 to the longest one)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    for q_len, seq_len in zip(query_lens, seq_lens, strict=True):
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"query length {q_len} must lie in [0, seq_len={seq_len}]")
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    if len(slot_mapping) < query_start_loc[-1]:
        raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {query_start_loc[-1]} tokens")
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
        slot_mapping=torch.tensor(list(slot_mapping), dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
        num_decodes=list(query_lens).count(1),
    )
