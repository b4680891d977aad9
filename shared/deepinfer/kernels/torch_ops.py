"""Torch twins of every kernel: the reference semantics, run on CPU and wherever no faster kernel exists.

Shapes follow kernels_iface: a ragged batch is T flat rows; the KV cache of one layer is
`[2, num_blocks, block_size, num_kv_heads, head_dim]` with index 0 = K and 1 = V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.metadata import AttentionMetadata


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
    )
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write this step's K/V rows into their cache slots, in place; a slot < 0 marks padding (not written)."""
    check_cache_write(key, value, kv_cache, slot_mapping)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, Hkv, D]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0].index_copy_(0, slots, key[keep])
    flat[1].index_copy_(0, slots, value[keep])


def check_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Assert the shapes and dtypes of a `reshape_and_cache` call (shared with its CPU version, cpu_ops)."""
    _check_kv_cache(kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert key.dim() == 3 and key.shape[1:] == (num_kv_heads, head_dim), (
        f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}"
    )
    assert key.dtype == value.dtype == kv_cache.dtype, (
        f"dtypes differ: key {key.dtype}, value {value.dtype}, kv_cache {kv_cache.dtype}"
    )
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K and V of one sequence's first seq_len positions: [2, seq_len, Hkv, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, n, block_size, Hkv, D]
    return blocks.flatten(1, 2)[:, :seq_len]


def _decode_rows(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    rows: list[int],
    out: torch.Tensor,
) -> None:
    """Attention of the single-token rows `rows` (sequence indices) in one batched gather; writes into out."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    seq_lens = torch.tensor([meta.seq_lens_cpu[b] for b in rows], device=query.device)
    token_rows = torch.tensor([meta.query_start_loc_cpu[b] for b in rows], device=query.device)
    num_blocks = -(-max(meta.seq_lens_cpu[b] for b in rows) // block_size)
    tables = meta.block_tables[torch.tensor(rows, device=query.device), :num_blocks].long()  # [R, n]
    context = kv_cache[:, tables].flatten(2, 3).float()  # [2, R, S, Hkv, D], S = n * block_size
    q = query[token_rows].float().view(len(rows), num_kv_heads, -1, head_dim)  # [R, Hkv, group, D]
    scores = torch.einsum("rhgd,rshd->rhgs", q, context[0]) * scale
    k_pos = torch.arange(context.shape[2], device=query.device)[None, :]
    allowed = k_pos < seq_lens[:, None]  # the row's own token sits at seq_len - 1
    if sliding_window is not None:
        allowed &= k_pos > seq_lens[:, None] - 1 - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    attended = torch.einsum("rhgs,rshd->rhgd", probs, context[1])  # [R, Hkv, group, D]
    out[token_rows] = attended.reshape(len(rows), -1, head_dim).to(out.dtype)


def check_attention_call(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Assert the shapes and dtypes of a `paged_attention` call (shared with its CPU version, sdpa_paged)."""
    _check_kv_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    assert query.dim() == 3 and query.shape[2] == head_dim, (
        f"query must be [T, Hq, {head_dim}], got {tuple(query.shape)}"
    )
    num_heads = query.shape[1]
    assert num_heads % num_kv_heads == 0, f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}"
    assert query.dtype == kv_cache.dtype, f"query {query.dtype} vs kv_cache {kv_cache.dtype}"
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    assert len(starts) == len(seq_lens) + 1 and starts[-1] <= query.shape[0], (
        f"query_start_loc_cpu {starts} does not fit seq_lens_cpu {seq_lens} and T={query.shape[0]}"
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its whole context in the paged cache (GQA aware).

    Rows past query_start_loc[-1] (batch padding) come back as zeros.
    """
    check_attention_call(query, kv_cache, meta)
    num_kv_heads = kv_cache.shape[3]
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    decode_rows = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] == 1]
    if len(decode_rows) > 1:  # one batched gather for all single-token rows: the CPU decode hot path
        _decode_rows(query, kv_cache, meta, scale, sliding_window, decode_rows, out)
    batched = set(decode_rows) if len(decode_rows) > 1 else set()
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or b in batched:
            continue
        assert q_len <= seq_len, f"sequence {b}: {q_len} new tokens but seq_len {seq_len}"
        k, v = _gather_context(kv_cache, meta.block_tables[b], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class AttentionPlan:
    """One step's `paged_attention` for layer after layer, into `out` (query, out and metadata fixed for the
    step, the layer's KV cache, scale and window per call). This twin recomputes each call; the Triton plan
    (triton_ops.AttentionPlan) launches its kernels again without Triton's per-launch host work."""

    def __init__(self, query: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
        self.query, self.out, self.meta = query, out, meta

    def __call__(self, kv_cache: torch.Tensor, scale: float, sliding_window: int | None = None) -> None:
        """Write the attention of this step over `kv_cache` (one layer's) into `out`."""
        self.out.copy_(paged_attention(self.query, kv_cache, self.meta, scale, sliding_window))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32, scaled by weight in x's dtype (as transformers)."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (
        f"rms_norm wants x [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}"
    )
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, norm=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual); `norm` in rms_norm's place when given (the CPU's own)."""
    assert x.shape == residual.shape, f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ"
    summed = residual + x
    return (norm or rms_norm)(summed, weight, eps), summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first rotary_dim features of x: [T, H, D] with cos/sin [T, 1, rotary_dim // 2]."""
    rotary_dim = cos.shape[-1] * 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # GPT-J style: pairs are interleaved (x0, x1), (x2, x3), ...
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE at each row's absolute position; cos_sin_cache is [max_position, rotary_dim] float32."""
    check_rotary_call(positions, query, key, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rotary_dim // 2] each
    cos = cos.unsqueeze(1).to(query.dtype)
    sin = sin.unsqueeze(1).to(query.dtype)
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def check_rotary_call(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Assert the shapes and dtypes of a `rotary_embedding` call (shared with its CPU version, cpu_ops)."""
    assert positions.dim() == 1 and positions.dtype == torch.int64, "positions must be [T] int64"
    assert query.dim() == 3 and key.dim() == 3, "query/key must be [T, H, D]"
    assert query.shape[0] == key.shape[0] == positions.shape[0], (
        f"T differs: positions {positions.shape[0]}, query {query.shape[0]}, key {key.shape[0]}"
    )
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2, "cos_sin_cache: [P, rot] f32"
    assert cos_sin_cache.shape[1] <= query.shape[2], "rotary_dim exceeds head_dim"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]): F.linear."""
    return F.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I]: GeGLU with transformers' `gelu_pytorch_tanh` (Gemma)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
