"""Which rows and heads each rank holds: pure index arithmetic over ints (no torch.distributed, no modules).

Heads are split contiguously. KV heads follow their query heads (GQA): with tp_size <= num_kv_heads each rank
holds num_kv_heads / tp_size of them; with tp_size > num_kv_heads each KV head is replicated on
tp_size / num_kv_heads consecutive ranks (vLLM's rule), so every rank still holds the one KV head its query
heads read:

    Hq=8, Hkv=2, tp=4:   rank     | 0       | 1       | 2       | 3       |
                         q heads  | 0 1     | 2 3     | 4 5     | 6 7     |
                         kv head  | 0       | 0       | 1       | 1       |
"""

from __future__ import annotations

from dataclasses import dataclass


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or ValueError naming `what` when it does not divide evenly."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds, as [start, start + count) in the model's head numbering."""

    q_start: int
    num_q_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """This rank's query and KV heads; ValueError when the heads cannot be split over tp_size ranks."""
    num_q = divide(num_heads, tp_size, "num_attention_heads")
    if tp_size <= num_kv_heads:
        num_kv = divide(num_kv_heads, tp_size, "num_key_value_heads")
        return HeadShard(rank * num_q, num_q, rank * num_kv, num_kv)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} > num_key_value_heads={num_kv_heads} needs a multiple of it "
            "(each KV head is replicated on tp_size / num_kv_heads ranks)"
        )
    return HeadShard(rank * num_q, num_q, rank // replicas, 1)


@dataclass(frozen=True)
class ColumnShard:
    """One HF tensor inside a (possibly fused) column-parallel weight: its full rows and this rank's slice."""

    name: str  # the HF part ("q_proj", "gate_proj", ...); "" for an unfused linear
    full_rows: int
    start: int  # first of this rank's rows, in the full tensor
    rows: int


def even_shards(names: tuple[str, ...], full_rows: int, tp_size: int, rank: int) -> tuple[ColumnShard, ...]:
    """Each named part of `full_rows` rows split evenly over the ranks (gate/up, unfused linears)."""
    rows = divide(full_rows, tp_size, f"rows of {'/'.join(n or 'linear' for n in names)}")
    return tuple(ColumnShard(name, full_rows, rank * rows, rows) for name in names)


def vocab_range(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """(start, num_valid, rows_per_rank): this rank holds token ids [start, start + num_valid), padded to
    rows_per_rank rows so that every rank's shard has the same shape (all_gather needs it)."""
    rows_per_rank = -(-vocab_size // tp_size)
    start = min(rank * rows_per_rank, vocab_size)
    return start, min(rows_per_rank, vocab_size - start), rows_per_rank

