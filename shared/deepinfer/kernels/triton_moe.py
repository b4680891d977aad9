"""Triton fused MoE: tokens grouped by expert on the device, then one grouped GEMM per projection.

Twin: `deepinfer.kernels.torch_moe.fused_moe`. The T*k (token, slot) pairs p = t * k + slot are sorted by
expert and each expert's segment is padded to a multiple of BLOCK_M, so every BLOCK_M block of the sorted
list belongs to one expert (vLLM's `moe_align_block_size`, here with device-side torch ops, no host sync):

    sorted_pair_ids  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- |  ("--" = num_pairs, padding)
    block_expert_ids |     0       |      2      |      2      |      5      | E E ...  (E: unused block)

GEMM 1 (gate and up together, SiLU-and-mul fused): act[p] = silu(x[t] · w13[e, :I]^T) * (x[t] · w13[e, I:]^T).
GEMM 2: pair_out[p] = weight[p] * act[p] · w2[e]^T in float32; the k slots of a token are then summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton_rounding import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_BLOCK_M = 16  # the smallest row count tl.dot takes
ONE_PROGRAM_MAX_PAIRS = 1024  # up to here one program aligns the pairs (decode); above, torch's sort (prefill)
ALIGN_CHUNK = 128  # pairs per step of the one-program alignment


@triton.jit
def _block_rows(sorted_pair_ids_ptr, block_expert_ids_ptr, num_pairs, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, pair ids [BLOCK_M], valid mask, token ids) of this program's block of the sorted pairs."""
    m_block = tl.program_id(0)
    expert = tl.load(block_expert_ids_ptr + m_block)
    pair_ids = tl.load(sorted_pair_ids_ptr + m_block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair_ids < num_pairs
    tokens = tl.where(valid, pair_ids // TOP_K, 0).to(tl.int64)
    return expert, pair_ids.to(tl.int64), valid, tokens


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    act_ptr, hidden_ptr, w13_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    stride_ht, stride_we, stride_wn, stride_at, num_pairs, num_experts, hidden_size, inter_size,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """One (pair block, column block of I): act [BLOCK_M, BLOCK_N] = silu(gate) * up of one expert."""
    expert, pair_ids, valid, tokens = _block_rows(sorted_pair_ids_ptr, block_expert_ids_ptr, num_pairs,
                                                  TOP_K, BLOCK_M)
    if expert >= num_experts:  # a block past the last expert's padded segment
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_base + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] rows of w13, read as columns
    up_rows = gate_rows + inter_size * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden_size
        x = tl.load(hidden_ptr + tokens[:, None] * stride_ht + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(gate_rows + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_rows + offs_k[:, None], mask=w_mask, other=0.0)
        if F32_DOT:
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
    dtype = act_ptr.dtype.element_ty
    # the twin rounds gate/up (F.linear), then silu(gate), then the product to the model dtype
    gate = round_to(acc_gate, dtype).to(tl.float32)
    up = round_to(acc_up, dtype).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(act_ptr + pair_ids[:, None] * stride_at + offs_n[None, :], round_to(silu * up, dtype),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    pair_out_ptr, act_ptr, w2_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    stride_at, stride_we, stride_wn, stride_pt, num_pairs, num_experts, hidden_size, inter_size,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """One (pair block, column block of H): pair_out [BLOCK_M, BLOCK_N] = weight * act · w2[e]^T (float32)."""
    expert, pair_ids, valid, _ = _block_rows(sorted_pair_ids_ptr, block_expert_ids_ptr, num_pairs,
                                             TOP_K, BLOCK_M)
    if expert >= num_experts:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter_size
        a = tl.load(act_ptr + pair_ids[:, None] * stride_at + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if F32_DOT:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weight = tl.load(topk_weights_ptr + pair_ids, mask=valid, other=0.0).to(tl.float32)
    expert_out = round_to(acc, act_ptr.dtype.element_ty).to(tl.float32)  # the twin's expert output dtype
    tl.store(pair_out_ptr + pair_ids[:, None] * stride_pt + offs_n[None, :], expert_out * weight[:, None],
             mask=valid[:, None] & n_mask[None, :])


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids [max_padded] int32, block_expert_ids [max_padded / block_m] int32), all on the device.

    max_padded = T*k + min(E, T*k) * (block_m - 1) rounded up to block_m: known on the host without a sync.
    """
    flat_ids = topk_ids.reshape(-1).long()
    num_pairs, device = flat_ids.shape[0], flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat_ids, stable=True)  # pair ids grouped by expert
    sorted_experts = flat_ids[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # E when unused
    return sorted_pair_ids, block_expert_ids


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(
    topk_ids_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """`align_pairs_to_blocks` in one program (sorted_pair_ids pre-filled with num_pairs): count the pairs per
    expert, pad each expert's segment to BLOCK_M, then place every pair at segment start + its rank among the
    expert's pairs in pair order (a stable sort), and name each block's expert (num_experts past the last)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    running = padded_end - padded  # where each expert's next pair goes
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # same-expert pairs before this one in the chunk
        dest = tl.sum(one_hot * (running[None, :] + earlier), axis=1)
        tl.store(sorted_pair_ids_ptr + dest, pairs, mask=pairs < num_pairs)
        running += tl.sum(one_hot, axis=0)
    padded_end = tl.where(experts < num_experts, padded_end, 1 << 30)
    for b0 in range(0, num_blocks, BLOCK_P):
        blocks = b0 + tl.arange(0, BLOCK_P)
        expert = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ids_ptr + blocks, tl.minimum(expert, num_experts), mask=blocks < num_blocks)


def align_pairs_one_program(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs_to_blocks` as one Triton program (two launches with the fill instead of ~25 torch ops): for
    decode batches, where launches, not pairs, cost the time."""
    flat_ids = topk_ids.reshape(-1)
    num_pairs = flat_ids.shape[0]
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat_ids.device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat_ids.device)
    _align_kernel[(1,)](
        flat_ids.contiguous(), sorted_pair_ids, block_expert_ids, num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=ALIGN_CHUNK, num_warps=4,
    )
    return sorted_pair_ids, block_expert_ids


@dataclass(frozen=True)
class MoeTiles:
    """Column/reduction tile and launch shape of both GEMM kernels (rows per block: `block_m`)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tiles(block_m: int, dtype: torch.dtype) -> MoeTiles:
    """64x64 tiles and 4 warps; 128x64 and 8 warps under 128-row blocks (float32: half the reduction tile).

    H200, V2-Lite experts, bf16 (`bench/gpu/gpu_moe_tiles.py`, 2026-11-29): 8,192 tokens 3.50 ms at 64x64x64/4 warps,
    2.66 ms at 128 rows x 128x64/8 warps.
    """
    block_k = 32 if dtype == torch.float32 else 64
    return MoeTiles(128, block_k, 8, 3) if block_m >= 128 else MoeTiles(64, block_k, 4, 3)


def pairs_in_own_blocks(topk_ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs_to_blocks`' output with pair p alone in block p (rows 1.. of each block are padding).

    Two device ops instead of the sort's dozen: the decode of a single sequence, whose launches dominate.
    """
    num_pairs = topk_ids.numel()
    rows = torch.arange(num_pairs * block_m, dtype=torch.int32, device=topk_ids.device)
    sorted_pair_ids = torch.where(rows % block_m == 0, rows // block_m, num_pairs)
    return sorted_pair_ids, topk_ids.reshape(-1).to(torch.int32)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small for decode (few pairs per expert), 128 once experts see hundreds of tokens."""
    per_expert = num_pairs / max(num_experts, 1)
    return MIN_BLOCK_M if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 192 else 128


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids) -> None:
    """Assert the shapes, dtypes and unit strides the kernels index with."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape == (num_experts, two_inter, hidden_size) and two_inter % 2 == 0, (
        f"w13 must be [E, 2I, {hidden_size}], got {tuple(w13.shape)}"
    )
    assert w2.shape == (num_experts, hidden_size, two_inter // 2), (
        f"w2 must be [{num_experts}, {hidden_size}, {two_inter // 2}], got {tuple(w2.shape)}"
    )
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (
        f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [T={num_tokens}, k]"
    )
    assert hidden.dtype == w13.dtype == w2.dtype and hidden.dtype in _DTYPES, (
        f"dtypes differ: hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    )
    assert hidden.stride(1) == w13.stride(2) == w2.stride(2) == 1, "hidden, w13 and w2 need unit last strides"


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [T, H] -> [T, H] in hidden.dtype.

    `block_m` / `tiles` override the tile choice (benchmarks sweep them; the defaults are `_tiles`).
    """
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    (num_tokens, hidden_size), (num_experts, two_inter, _) = hidden.shape, w13.shape
    inter_size, top_k = two_inter // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    if block_m is None and num_tokens == 1:
        # one token's k experts are distinct: a block per pair reads each expert once, with no sort
        block_m = MIN_BLOCK_M
        sorted_pair_ids, block_expert_ids = pairs_in_own_blocks(topk_ids, block_m)
    else:
        block_m = block_m or _block_m(num_pairs, num_experts)
        align = align_pairs_one_program if num_pairs <= ONE_PROGRAM_MAX_PAIRS else align_pairs_to_blocks
        sorted_pair_ids, block_expert_ids = align(topk_ids, num_experts, block_m)
    num_blocks = block_expert_ids.shape[0]
    f32_dot = hidden.device.type == "cpu"  # the interpreter's numpy matmul cannot multiply bfloat16
    precision = "ieee" if hidden.dtype == torch.float32 or f32_dot else "tf32"
    tiles = tiles or (MoeTiles(32, 32, 4, 3) if f32_dot else _tiles(block_m, hidden.dtype))
    block_n, block_k = tiles.block_n, tiles.block_k

    act = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)  # row p = pair p
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        act, hidden, w13, sorted_pair_ids, block_expert_ids,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), num_pairs, num_experts, hidden_size,
        inter_size, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        F32_DOT=f32_dot, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        pair_out, act, w2, weights, sorted_pair_ids, block_expert_ids,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), num_pairs, num_experts, hidden_size,
        inter_size, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        F32_DOT=f32_dot, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    # every pair row is written exactly once (each pair sits in one block), so no zero-fill is needed
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
