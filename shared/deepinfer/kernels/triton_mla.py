"""Triton MLA decode attention over the paged latent cache `[num_blocks, block_size, kv_lora_rank + rope_dim]`.

Twin: `deepinfer.kernels.torch_mla.mla_paged_attention`, absorbed form: the query is already in latent space,
[T, H, kv_lora_rank + rope_dim]; every head attends to the one shared cache row (K = the row, V = its first
kv_lora_rank elements). A program takes BLOCK_H heads of one sequence, so each latent row is read once for
all of them:

    scores [BLOCK_H, BLOCK_N] = q_c [BLOCK_H, C] · c_kv^T [C, BLOCK_N] + q_pe [BLOCK_H, R] · k_pe^T [R, BLOCK_N]
    acc    [BLOCK_H, C]      += softmax-weighted c_kv rows

Long contexts are split into partitions of `partition_size` keys (split-K) and merged by the reduce kernel of
the standard paged decode attention, whose (max, sum, partial output) layout this kernel writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import torch_mla
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.triton_attention import _decode_reduce_kernel, _online_softmax_step
from deepinfer.kernels.triton_rounding import round_to

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_PROGRAMS = 264  # two per SM of an H100/H200
MAX_PARTITION = 512
MAX_PARTITIONS = 16


@triton.jit(do_not_specialize=["stride_bt", "partition_size", "num_seqs", "num_partitions"])
def _mla_decode_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co,
    qk_scale, partition_size, num_seqs, num_heads, num_partitions,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """One (sequence, head block, partition): BLOCK_H query heads against the partition's latent rows."""
    b = tl.program_id(0)
    part = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_row
    seq_len = tl.load(seq_lens_ptr + b)
    part_start = part * partition_size
    if q_len == 0 or part_start >= seq_len:  # batch padding, or a partition the reduce kernel skips
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < KV_RANK
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE_DIM
    q_base = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=h_mask[:, None] & c_mask[None, :], other=0.0)  # [H, C]
    q_pe = tl.load(q_base + KV_RANK + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if F32_DOT:
        q_c, q_pe = q_c.to(tl.float32), q_pe.to(tl.float32)
    block_table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    hi = tl.minimum(part_start + partition_size, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for start in range(part_start, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_co  # [BLOCK_N] row starts
        c_kv = tl.load(row[:, None] + offs_c[None, :], mask=pos_mask[:, None] & c_mask[None, :], other=0.0)
        k_pe = tl.load(row[None, :] + KV_RANK + offs_r[:, None], mask=pos_mask[None, :] & r_mask[:, None],
                       other=0.0)  # [BLOCK_R, BLOCK_N]
        if F32_DOT:
            c_kv, k_pe = c_kv.to(tl.float32), k_pe.to(tl.float32)
        s = tl.dot(q_c, tl.trans(c_kv), input_precision=PRECISION)
        s = tl.dot(q_pe, k_pe, s, input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, c_kv, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:
        # part_out: [B, H, P, BLOCK_C] float32; part_ml: [2, B, H, P] float32 (max then sum)
        ml_off = (b * num_heads + heads) * num_partitions + part  # [BLOCK_H]
        tl.store(part_ml_ptr + ml_off, m_i, mask=h_mask)
        tl.store(part_ml_ptr + num_seqs * num_heads * num_partitions + ml_off, l_i, mask=h_mask)
        tl.store(part_out_ptr + ml_off[:, None] * BLOCK_C + offs_c[None, :], out, mask=h_mask[:, None])
    else:
        o_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


@triton.jit
def _mla_cache_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, stride_ct, stride_pt, stride_cb, stride_co,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token: its [kv_c ‖ k_pe] row to slot_mapping[t]; a slot < 0 is padding (no host-side mask)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_mask, r_mask = offs_c < KV_RANK, offs_r < ROPE_DIM
    tl.store(row + offs_c, tl.load(kv_c_ptr + t * stride_ct + offs_c, mask=c_mask), mask=c_mask)
    tl.store(row + KV_RANK + offs_r, tl.load(k_pe_ptr + t * stride_pt + offs_r, mask=r_mask), mask=r_mask)


def mla_cache_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The twin's `mla_cache_write` without its boolean mask (a host sync), so CUDA graphs can capture it."""
    torch_mla.check_cache_write(kv_c, k_pe, latent_cache, slot_mapping)
    assert kv_c.stride(1) == 1 and k_pe.stride(1) == 1 and slot_mapping.is_contiguous()
    if kv_c.shape[0] == 0:
        return
    kv_lora_rank, rope_dim = kv_c.shape[1], k_pe.shape[1]
    _mla_cache_write_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, latent_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
        latent_cache.stride(0), latent_cache.stride(1),
        KV_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_C=triton.next_power_of_2(kv_lora_rank),
        BLOCK_R=triton.next_power_of_2(rope_dim), BLOCK_SIZE=latent_cache.shape[1], num_warps=4,
    )


def _check_inputs(query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int):
    """Assert the shapes, dtypes and strides the kernel indexes with."""
    assert latent_cache.dim() == 3 and latent_cache.is_contiguous(), (
        f"latent_cache must be contiguous [num_blocks, block_size, latent_dim], got {tuple(latent_cache.shape)}"
    )
    assert query.dim() == 3 and query.shape[2] == latent_cache.shape[2] and query.stride(2) == 1, (
        f"query must be [T, H, {latent_cache.shape[2]}] with unit last stride, got {tuple(query.shape)}"
    )
    assert 0 < kv_lora_rank < latent_cache.shape[2], f"kv_lora_rank {kv_lora_rank} vs {latent_cache.shape[2]}"
    assert query.dtype == latent_cache.dtype and query.dtype in _DTYPES, (
        f"query {query.dtype} vs latent_cache {latent_cache.dtype}"
    )
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1, "block_tables: int32 rows"
    assert meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32, "seq_lens/query_start_loc: int32"
    assert meta.seq_lens.is_contiguous() and meta.query_start_loc.is_contiguous()
    assert meta.query_start_loc_cpu[-1] <= query.shape[0], "query_start_loc exceeds the query rows"


def _partition_size(max_seq_len: int, num_programs: int, block_n: int) -> int:
    """Keys per split-K partition: enough programs to fill the GPU (TARGET_PROGRAMS), at most 512 keys, and at
    most MAX_PARTITIONS partitions (the reduce kernel holds them all in registers).

    One sequence's 16 heads share a program, so a single decode at 2k keys with 512-key partitions ran 4
    programs (38 us a layer on an H200); 128-key partitions make it 16.
    """
    max_seq_len = max(max_seq_len, 1)
    wanted = triton.next_power_of_2(triton.cdiv(max_seq_len * num_programs, TARGET_PROGRAMS))
    fewest = triton.next_power_of_2(triton.cdiv(max_seq_len, MAX_PARTITIONS))
    return max(block_n, fewest, min(MAX_PARTITION, wanted))


def mla_decode_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_lora_rank: int,
    *, partition_size: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA for batches with at most one new token per sequence: -> [T, H, kv_lora_rank] in query.dtype."""
    _check_inputs(query, latent_cache, meta, kv_lora_rank)
    assert meta.max_query_len <= 1, f"MLA decode kernel got max_query_len={meta.max_query_len}"
    num_seqs, num_heads = meta.seq_lens.shape[0], query.shape[1]
    out = torch.empty(query.shape[0], num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    out[meta.query_start_loc_cpu[-1]:].zero_()  # batch padding rows are zeros, as in the twin
    if num_seqs == 0 or meta.query_start_loc_cpu[-1] == 0:
        return out
    f32_dot = query.device.type == "cpu"  # the interpreter's numpy matmul cannot multiply bfloat16
    block_n = 16 if f32_dot or query.dtype == torch.float32 else 32  # fp32 tiles: half the shared memory
    block_h = 16
    if partition_size is None:
        partition_size = _partition_size(meta.max_seq_len, num_seqs * triton.cdiv(num_heads, block_h), block_n)
    assert partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
    num_partitions = triton.cdiv(max(meta.max_seq_len, 1), partition_size)
    split = num_partitions > 1
    if not split:
        partition_size = max(meta.max_seq_len, 1)
    block_c = triton.next_power_of_2(kv_lora_rank)
    part_out = part_ml = out  # placeholders, unused without a split
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_partitions, block_c, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(2, num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
    _mla_decode_kernel[(num_seqs, triton.cdiv(num_heads, block_h), num_partitions)](
        out, part_out, part_ml, query, latent_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        latent_cache.stride(0), latent_cache.stride(1),
        scale * _LOG2E, partition_size, num_seqs, num_heads, num_partitions,
        KV_RANK=kv_lora_rank, ROPE_DIM=latent_cache.shape[2] - kv_lora_rank, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(latent_cache.shape[2] - kv_lora_rank)), BLOCK_H=block_h,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=block_n, SPLIT=split,
        PRECISION="ieee" if query.dtype == torch.float32 or f32_dot else "tf32", F32_DOT=f32_dot,
        num_warps=4, num_stages=2,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_ml, meta.seq_lens, meta.query_start_loc,
            out.stride(0), out.stride(1), partition_size, num_seqs, num_heads, num_partitions,
            HEAD_DIM=kv_lora_rank, BLOCK_D=block_c, PART_PAD=triton.next_power_of_2(num_partitions), num_warps=4,
        )
    return out


def mla_paged_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """The twin's signature: decode-only batches take the Triton kernel, others (prefill rows) the torch twin."""
    # the choice reads only host ints, so it never waits for the device
    if meta.max_query_len <= 1:
        return mla_decode_attention(query, latent_cache, meta, scale, kv_lora_rank)
    return torch_mla.mla_paged_attention(query, latent_cache, meta, scale, kv_lora_rank)
