"""Triton paged attention over the KV cache `[2, num_blocks, block_size, Hkv, D]`: decode and prefill.

Both kernels walk each sequence's block table inside the kernel, map query head h to kv head
h // (Hq // Hkv) (GQA), and run an online softmax (flash-attention style) in float32 with exp2.
Key position j of sequence b lives in the cache at

    block = block_tables[b, j // block_size]     slot = block * block_size + j % block_size

Decode (q_len <= 1 for every sequence) splits long contexts into partitions of `partition_size` keys
(split-K); each partition writes (max, sum, partial output) and a reduce kernel merges them.

A mixed step (decode rows beside prompt rows) runs both into one output: the prefill kernel skips the
sequences with a single new row (`min_query_len=2`) and the decode kernel takes exactly those. In the prefill
kernel a decode row would fill one row of a BLOCK_M-row tile and read its kv head's keys once per query head;
the decode kernel reads them once per kv head, for all GROUP heads together, and splits long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.triton_launch import Launch, launch_now
from deepinfer.kernels.triton_rounding import round_to

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_ptr, kv_head, pos, pos_mask, offs_d, d_mask,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr, F32_DOT: tl.constexpr,
):
    """Gather K or V rows at absolute positions `pos` [BLOCK_N] -> [D, N] if TRANSPOSED else [N, D]."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch  # [N] element offsets
    if TRANSPOSED:
        ptrs = cache_ptr + row[None, :] + offs_d[:, None]
        mask = pos_mask[None, :] & d_mask[:, None]
    else:
        ptrs = cache_ptr + row[:, None] + offs_d[None, :]
        mask = pos_mask[:, None] & d_mask[None, :]
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if F32_DOT:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 domain, -inf where masked) and V [N, D] into (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with every key masked so far keeps m = -inf; subtract 0 instead so that exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt", "partition_size", "num_seqs", "num_partitions"])
def _decode_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    qk_scale, sliding_window, partition_size, num_seqs, num_heads, num_partitions,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """One (sequence, kv head, partition): all GROUP query heads of the kv head against its keys."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_row
    seq_len = tl.load(seq_lens_ptr + b)
    part_start = part * partition_size
    # batch padding (q_len 0), a prompt of a mixed step (the prefill kernel's), or a partition the reduce skips
    if q_len != 1 or part_start >= seq_len:
        return
    q_pos = seq_len - 1

    offs_g = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [GROUP_PAD, BLOCK_D]
    if F32_DOT:
        q = q.to(tl.float32)

    # keys [lo, hi) of this partition; the window drops keys at q_pos - j >= sliding_window
    hi = tl.minimum(part_start + partition_size, seq_len)
    lo = part_start
    if USE_WINDOW:
        lo = tl.maximum(lo, (q_pos - sliding_window + 1) // BLOCK_N * BLOCK_N)
    block_table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, kv_head, pos, pos_mask, offs_d, d_mask,
                          stride_cb, stride_co, stride_ch, BLOCK_SIZE, True, F32_DOT)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        keep = pos_mask
        if USE_WINDOW:
            keep = keep & (q_pos - pos < sliding_window)
        s = tl.where(keep[None, :], s, float("-inf"))
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, kv_head, pos, pos_mask, offs_d, d_mask,
                          stride_cb, stride_co, stride_ch, BLOCK_SIZE, False, F32_DOT)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty partition has l = 0 and acc = 0
    if SPLIT:
        # part_out: [B, Hq, P, BLOCK_D] float32; part_ml: [2, B, Hq, P] float32 (max then sum)
        ml_off = (b * num_heads + heads) * num_partitions + part  # [GROUP_PAD]
        tl.store(part_ml_ptr + ml_off, m_i, mask=g_mask)
        tl.store(part_ml_ptr + num_seqs * num_heads * num_partitions + ml_off, l_i, mask=g_mask)
        tl.store(part_out_ptr + ml_off[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_mask[:, None])
    else:
        o_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["partition_size", "num_seqs", "num_partitions"])
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, partition_size, num_seqs, num_heads, num_partitions,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PART_PAD: tl.constexpr,
):
    """Merge the partitions of one (sequence, query head) by their softmax max and sum."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + b).to(tl.int64)
    if tl.load(query_start_loc_ptr + b + 1) - q_row != 1:  # padding, or a prompt of a mixed step
        return
    seq_len = tl.load(seq_lens_ptr + b)
    offs_p = tl.arange(0, PART_PAD)
    p_mask = offs_p < tl.cdiv(seq_len, partition_size)  # partitions past seq_len were never written
    offs_d = tl.arange(0, BLOCK_D)
    ml_off = (b * num_heads + head) * num_partitions + offs_p
    m = tl.load(part_ml_ptr + ml_off, mask=p_mask, other=float("-inf"))
    l_sum = tl.load(part_ml_ptr + num_seqs * num_heads * num_partitions + ml_off, mask=p_mask, other=0.0)
    m_max = tl.max(m, 0)  # finite: the last partition always holds the query's own key
    w = tl.where(p_mask, tl.exp2(m - m_max) * l_sum, 0.0)  # [PART_PAD]
    part_out = tl.load(part_out_ptr + ml_off[:, None] * BLOCK_D + offs_d[None, :], mask=p_mask[:, None],
                       other=0.0)  # [PART_PAD, BLOCK_D]
    out = tl.sum(part_out * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, round_to(out, out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_block(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, m_block, b, head,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    qk_scale, sliding_window, min_query_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Query block m_block of sequence b, query head `head`: BLOCK_M new rows against the cached prefix and
    themselves. Nothing past the sequence's rows, nor for a sequence of fewer than min_query_len new rows."""
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if m_block * BLOCK_M < q_len and q_len >= min_query_len:
        seq_len = tl.load(seq_lens_ptr + b)
        context_len = seq_len - q_len  # row i of this sequence sits at position context_len + i
        kv_head = head // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        q_pos = context_len + offs_m  # [BLOCK_M]
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if F32_DOT:
            q = q.to(tl.float32)
        block_table_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt

        #   keys: [lo ........ mid)[mid ......... hi)
        #          every row sees  causal/window mask; hi = last row's position + 1
        first_pos = context_len + m_block * BLOCK_M
        hi = tl.minimum(first_pos + BLOCK_M, seq_len)
        if USE_WINDOW:
            lo = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
            mid = lo
        else:
            lo = 0
            mid = first_pos // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        all_keys = tl.full([BLOCK_N], 1, tl.int1)
        for start in range(lo, mid, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k = _load_kv_tile(k_cache_ptr, block_table_ptr, kv_head, pos, all_keys, offs_d, d_mask,
                              stride_cb, stride_co, stride_ch, BLOCK_SIZE, True, F32_DOT)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            v = _load_kv_tile(v_cache_ptr, block_table_ptr, kv_head, pos, all_keys, offs_d, d_mask,
                              stride_cb, stride_co, stride_ch, BLOCK_SIZE, False, F32_DOT)
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
        for start in range(mid, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_mask = pos < hi
            k = _load_kv_tile(k_cache_ptr, block_table_ptr, kv_head, pos, pos_mask, offs_d, d_mask,
                              stride_cb, stride_co, stride_ch, BLOCK_SIZE, True, F32_DOT)
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            keep = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                keep = keep & (q_pos[:, None] - pos[None, :] < sliding_window)
            s = tl.where(keep, s, float("-inf"))
            v = _load_kv_tile(v_cache_ptr, block_table_ptr, kv_head, pos, pos_mask, offs_d, d_mask,
                              stride_cb, stride_co, stride_ch, BLOCK_SIZE, False, F32_DOT)
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["stride_bt", "min_query_len"])
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    qk_scale, sliding_window, min_query_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """One (query block, sequence, query head); a decode row of a mixed step (min_query_len 2) is skipped."""
    _prefill_block(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
        qk_scale, sliding_window, min_query_len,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_SIZE, BLOCK_M, BLOCK_N, USE_WINDOW, PRECISION, F32_DOT,
    )


def _check_attention_inputs(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Assert the shapes, dtypes and strides the kernels index with."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous(), (
        f"kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
    )
    assert query.dim() == 3 and query.shape[2] == kv_cache.shape[4] and query.stride(2) == 1, (
        f"query must be [T, Hq, {kv_cache.shape[4]}] with unit last stride, got {tuple(query.shape)}"
    )
    assert query.shape[1] % kv_cache.shape[3] == 0, f"Hq={query.shape[1]} not a multiple of Hkv={kv_cache.shape[3]}"
    assert query.dtype == kv_cache.dtype and query.dtype in _DTYPES, f"query {query.dtype} vs cache {kv_cache.dtype}"
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1, "block_tables: int32 rows"
    assert meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32, "seq_lens/query_start_loc: int32"
    assert meta.seq_lens.is_contiguous() and meta.query_start_loc.is_contiguous()
    assert meta.query_start_loc.shape[0] == meta.seq_lens.shape[0] + 1 == meta.block_tables.shape[0] + 1
    assert meta.query_start_loc_cpu[-1] <= query.shape[0], "query_start_loc exceeds the query rows"


def _new_output(query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Output [T, Hq, D]; rows past query_start_loc[-1] (batch padding) are zeros, as in the torch twin."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out[meta.query_start_loc_cpu[-1]:].zero_()
    return out


def _f32_dot(query: torch.Tensor) -> bool:
    """Upcast dot operands on CPU: the Triton interpreter's numpy matmul cannot multiply bfloat16."""
    return query.device.type == "cpu"


def _precision(query: torch.Tensor) -> str:
    """Full fp32 dots for fp32 operands (parity to 1e-5); 16-bit operands run on tensor cores either way."""
    return "ieee" if query.dtype == torch.float32 or _f32_dot(query) else "tf32"


def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
    *, partition_size: int = 512, out: torch.Tensor | None = None, launch: Launch = launch_now,
) -> torch.Tensor:
    """Attention of the sequences with exactly one new row. Alone (`out=None`) for decode batches
    (meta.max_query_len <= 1), split over `partition_size`-key partitions; in a mixed step into `out`, where the
    prefill kernel wrote the prompts' rows (and checked the inputs), one partition a sequence: a mixed step runs
    its attention eagerly, so a reduce launch and two scratch buffers a layer would cost more host time than the
    split saves on the device. `launch`: see triton_launch."""
    mixed = out is not None
    if not mixed:
        _check_attention_inputs(query, kv_cache, meta)
        assert meta.max_query_len <= 1, f"decode kernel got max_query_len={meta.max_query_len} without out="
        out = _new_output(query, meta)
    num_seqs, (num_heads, head_dim), num_kv_heads = meta.seq_lens.shape[0], query.shape[1:], kv_cache.shape[3]
    if num_seqs == 0 or meta.query_start_loc_cpu[-1] == 0:
        return out
    block_n = 64
    assert partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
    num_partitions = 1 if mixed else triton.cdiv(max(meta.max_seq_len, 1), partition_size)
    split = num_partitions > 1
    if not split:
        partition_size = max(meta.max_seq_len, 1)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    part_out = part_ml = out  # placeholders, unused without a split
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_partitions, block_d, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(2, num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
    window = sliding_window or 0
    launch(
        _decode_kernel, (num_seqs, num_kv_heads, num_partitions), out, part_out, part_ml, query, kv_cache[0], kv_cache[1],
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale * _LOG2E, window, partition_size, num_seqs, num_heads, num_partitions,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=block_n, USE_WINDOW=window > 0, SPLIT=split,
        PRECISION=_precision(query), F32_DOT=_f32_dot(query), num_warps=4, num_stages=2,
    )
    if split:
        launch(
            _decode_reduce_kernel, (num_seqs, num_heads), out, part_out, part_ml, meta.seq_lens, meta.query_start_loc,
            out.stride(0), out.stride(1), partition_size, num_seqs, num_heads, num_partitions,
            HEAD_DIM=head_dim, BLOCK_D=block_d, PART_PAD=triton.next_power_of_2(num_partitions), num_warps=4,
        )
    return out


def prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
    *, min_query_len: int = 1, out: torch.Tensor | None = None, launch: Launch = launch_now,
) -> torch.Tensor:
    """Varlen causal attention of every sequence's new rows over its cached prefix and themselves; sequences with
    fewer than `min_query_len` new rows are skipped (their output rows are left unwritten). Into `out` when given
    (its rows past query_start_loc[-1] left as they are), else a new output. `launch`: see triton_launch."""
    _check_attention_inputs(query, kv_cache, meta)
    out = _new_output(query, meta) if out is None else out
    num_seqs, (num_heads, head_dim), num_kv_heads = meta.seq_lens.shape[0], query.shape[1:], kv_cache.shape[3]
    if num_seqs == 0 or meta.max_query_len < min_query_len:
        return out
    block_d = triton.next_power_of_2(head_dim)
    fp32 = query.dtype == torch.float32
    big = 32 if fp32 else 64 if block_d > 128 else 128
    block_m = min(big, max(16, triton.next_power_of_2(meta.max_query_len)))
    block_n = 32 if fp32 else 64
    window = sliding_window or 0
    grid = (triton.cdiv(meta.max_query_len, block_m), num_seqs, num_heads)
    launch(
        _prefill_kernel, grid, out, query, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale * _LOG2E, window, min_query_len,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=block_n, USE_WINDOW=window > 0, PRECISION=_precision(query),
        F32_DOT=_f32_dot(query),
        num_warps=8 if block_m == 128 else 4, num_stages=2,
    )
    return out

