"""Dense [B, V] tensors of a step's sparse per-row token lists: logit bias, prompt / output token masks, grammars."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned memory + non_blocking: the copy is queued behind the running step instead of waiting for it.
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flat_index(rows: dict[int, Sequence[int]], vocab_size: int, what: str) -> torch.Tensor:
    """Indices into a flattened [B, V] tensor for every (row, token id) pair; checks the ids on the host."""
    parts = [torch.as_tensor(ids, dtype=torch.int64) + row * vocab_size for row, ids in rows.items() if len(ids)]
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    flat = torch.cat(parts)
    token_ids = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in rows.values() if len(ids)])
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
        raise ValueError(f"{what} holds a token id outside [0, {vocab_size})")
    return flat


def dense_rows(
    rows: dict[int, Sequence[int]], num_rows: int, vocab_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[B, V] presence mask (bool) or occurrence counts (int32) of the given token ids, built on device."""
    index = to_device(flat_index(rows, vocab_size, "prompt_token_ids or output_token_ids"), device)
    dense = torch.zeros(num_rows * vocab_size, dtype=dtype, device=device)
    if dtype == torch.bool:
        dense.index_fill_(0, index, True)
    else:
        dense.index_add_(0, index, torch.ones(index.shape, dtype=dtype, device=device))
    return dense.view(num_rows, vocab_size)


def dense_bias(
    biases: dict[int, list[tuple[int, float]]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[B, V] float32 sum of each row's (token id, bias) entries; None when no row has one."""
    if not biases:
        return None
    index = flat_index({r: [t for t, _ in e] for r, e in biases.items()}, vocab_size, "logit_bias or stop ids")
    values = torch.tensor([b for e in biases.values() for _, b in e], dtype=torch.float32)
    dense = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    # index_add_: a token both biased and banned sums to -inf, whichever order the adds land in.
    dense.index_add_(0, to_device(index, device), to_device(values, device))
    return dense.view(num_rows, vocab_size)


def allowed_tokens(
    bitmasks: Sequence[bytes | None], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[B, V] bool from grammar bitmasks (bit t of int32 word t // 32, little-endian); rows without one allow
    everything, and a grammar row allows no id past its bitmask (a model vocabulary wider than the tokenizer's)."""
    if bitmasks.count(None) == len(bitmasks):  # no grammar row (count: one C loop, no generator)
        return None
    num_words = max(len(mask) for mask in bitmasks if mask is not None) // 4
    words = torch.full((num_rows, num_words), -1, dtype=torch.int32)
    for row, mask in enumerate(bitmasks):
        if mask is not None:
            row_words = torch.frombuffer(bytearray(mask), dtype=torch.int32)
            words[row].zero_()
            words[row, : row_words.numel()] = row_words
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, num_words * 32)
    if bits.shape[1] < vocab_size:
        free_rows = torch.tensor([mask is None for mask in bitmasks]).unsqueeze(1)
        bits = torch.cat([bits, free_rows.expand(num_rows, vocab_size - bits.shape[1])], dim=1)
    return to_device(bits[:, :vocab_size].contiguous(), device)
