"""`SamplingMetadata`: one step's sampling parameters as device tensors, plus host flags choosing the stages to run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.seeds import as_int64

_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row tensors for a batch of B sequences, and host-side flags so `Sampler.forward` never reads the device.

    Rows whose stage is off hold its neutral value (top_k = vocab_size, top_p = 1, min_p = 0, penalties neutral);
    greedy rows hold temperature 1 (their probabilities are computed but never used).
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab_size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, absolute position of the token being sampled
    is_greedy: torch.Tensor  # [B] bool
    logit_bias: torch.Tensor | None  # [B, V] float32, only if a row has a bias or is below min_tokens
    prompt_mask: torch.Tensor | None  # [B, V] bool, token seen in the prompt; only if need_penalties
    output_counts: torch.Tensor | None  # [B, V] int32, times generated so far; only if need_penalties
    allowed: torch.Tensor | None  # [B, V] bool, tokens a row's grammar allows next; only if a row has one
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    any_random: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_penalties: bool
    max_top_k: int  # largest top_k among rows that use top-k (0 when none)
    top_p_within_top_k: bool  # every top-p row also uses top-k: top-p runs on the top-k values, no full sort
    max_num_logprobs: int  # largest `logprobs` asked, capped at vocab_size (0: only the sampled token's)

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        positions: Sequence[int],
        seeds: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        *,
        eos_token_ids: Sequence[int] = (),
        grammar_bitmasks: Sequence[bytes | None] = (),
    ) -> SamplingMetadata:
        """Build one step's metadata on the host. `seeds[i]` is `params.seed` when set, else the seed the engine
        drew at admission (`deepinfer.sampling.seeds.draw_seed`); uint64 seeds are accepted. `eos_token_ids` and
        `stop_token_ids` are banned (bias -inf) while a row has fewer than `min_tokens` output tokens.
        `grammar_bitmasks[i]`: row i's allowed next tokens from its grammar matcher (None: no grammar).
        """
        num_rows = len(params_list)
        for name, seq in (("positions", positions), ("seeds", seeds), ("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids)):
            if len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows, params_list has {num_rows}")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params_list]
        stages = [_random_stages(p, vocab_size) for p in params_list]
        temperature, top_k, top_p, min_p = (list(col) for col in zip(*stages, strict=True)) if stages else ([],) * 4
        floats = torch.tensor(
            [temperature, top_p, min_p, [p.repetition_penalty for p in params_list],
             [p.presence_penalty for p in params_list], [p.frequency_penalty for p in params_list]],
            dtype=torch.float32,
        ).reshape(6, num_rows)
        ints = torch.tensor(
            [top_k, [as_int64(s) for s in seeds], list(positions), [int(g) for g in greedy]], dtype=torch.int64
        ).reshape(4, num_rows)
        temperature_t, top_p_t, min_p_t, rep, presence, frequency = _to_device(floats, device).unbind(0)
        top_k_t, seeds_t, positions_t, greedy_t = _to_device(ints, device).unbind(0)

        penalised = [_uses_penalties(p) for p in params_list]
        need_penalties = any(penalised)
        prompt_mask = output_counts = None
        if need_penalties:
            repeated = {i: prompt_token_ids[i] for i, p in enumerate(params_list) if p.repetition_penalty != 1}
            prompt_mask = _dense_rows(repeated, num_rows, vocab_size, device, torch.bool)
            generated = {i: output_token_ids[i] for i, used in enumerate(penalised) if used}
            output_counts = _dense_rows(generated, num_rows, vocab_size, device, torch.int32)
        enabled_k = [k for k in top_k if k < vocab_size]
        return cls(
            temperature=temperature_t, top_k=top_k_t, top_p=top_p_t, min_p=min_p_t, repetition_penalty=rep,
            presence_penalty=presence, frequency_penalty=frequency, seeds=seeds_t, positions=positions_t,
            is_greedy=greedy_t.bool(),
            logit_bias=_logit_bias(params_list, output_token_ids, eos_token_ids, vocab_size, device),
            prompt_mask=prompt_mask, output_counts=output_counts,
            allowed=_allowed_tokens(grammar_bitmasks, num_rows, vocab_size, device), vocab_size=vocab_size,
            all_greedy=all(greedy), any_greedy=any(greedy), any_random=not all(greedy),
            need_top_k=bool(enabled_k), need_top_p=any(p < 1 for p in top_p), need_min_p=any(p > 0 for p in min_p),
            need_penalties=need_penalties, max_top_k=max(enabled_k, default=0),
            top_p_within_top_k=all(k < vocab_size for k, p in zip(top_k, top_p, strict=True) if p < 1),
            max_num_logprobs=min(max((p.logprobs or 0 for p in params_list), default=0), vocab_size),
        )


def _random_stages(p: SamplingParams, vocab_size: int) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) of a row; a greedy row gets every stage's neutral value, so the
    need_* flags count random rows only."""
    if p.is_greedy:
        return 1.0, vocab_size, 1.0, 0.0
    # A temperature this small is greedy in all but name; the floor keeps logits / temperature finite.
    return max(p.temperature, _MIN_TEMPERATURE), _top_k_or_off(p.top_k, vocab_size), p.top_p, p.min_p


def _top_k_or_off(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned memory + non_blocking: the copy is queued behind the running step instead of waiting for it.
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _flat_index(rows: dict[int, Sequence[int]], vocab_size: int, what: str) -> torch.Tensor:
    """Indices into a flattened [B, V] tensor for every (row, token id) pair; checks the ids on the host."""
    parts = [torch.as_tensor(ids, dtype=torch.int64) + row * vocab_size for row, ids in rows.items() if len(ids)]
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    flat = torch.cat(parts)
    token_ids = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in rows.values() if len(ids)])
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
        raise ValueError(f"{what} holds a token id outside [0, {vocab_size})")
    return flat


def _dense_rows(
    rows: dict[int, Sequence[int]], num_rows: int, vocab_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[B, V] presence mask (bool) or occurrence counts (int32) of the given token ids, built on device."""
    index = _to_device(_flat_index(rows, vocab_size, "prompt_token_ids or output_token_ids"), device)
    dense = torch.zeros(num_rows * vocab_size, dtype=dtype, device=device)
    if dtype == torch.bool:
        dense.index_fill_(0, index, True)
    else:
        dense.index_add_(0, index, torch.ones(index.shape, dtype=dtype, device=device))
    return dense.view(num_rows, vocab_size)


def _logit_bias(
    params_list: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Dense [B, V] bias: the user's logit_bias, plus -inf on stop/EOS tokens for rows still below min_tokens."""
    biases: dict[int, list[tuple[int, float]]] = {}
    for row, p in enumerate(params_list):
        entries = list((p.logit_bias or {}).items())
        if len(output_token_ids[row]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            entries += [(t, float("-inf")) for t in sorted(banned)]
        if entries:
            biases[row] = entries
    if not biases:
        return None
    index = _flat_index({r: [t for t, _ in e] for r, e in biases.items()}, vocab_size, "logit_bias or stop ids")
    values = torch.tensor([b for e in biases.values() for _, b in e], dtype=torch.float32)
    dense = torch.zeros(len(params_list) * vocab_size, dtype=torch.float32, device=device)
    # index_add_: a token both biased and banned sums to -inf, whichever order the adds land in.
    dense.index_add_(0, _to_device(index, device), _to_device(values, device))
    return dense.view(len(params_list), vocab_size)


def _allowed_tokens(
    bitmasks: Sequence[bytes | None], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[B, V] bool from grammar bitmasks (bit t of int32 word t // 32, little-endian); rows without one allow
    everything, and a grammar row allows no id past its bitmask (a model vocabulary wider than the tokenizer's)."""
    if not any(mask is not None for mask in bitmasks):
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
    return _to_device(bits[:, :vocab_size].contiguous(), device)
