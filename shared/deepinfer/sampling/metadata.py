"""`SamplingMetadata`: one step's sampling parameters as device tensors, plus host flags choosing the stages to run.

`SamplingMetadataBuilder` builds it every step for the runner: what a request's SamplingParams imply is derived once
per request (`RowConstants`), the batch's packed constants and host flags once per batch composition
(`_BatchConstants`), so a decode step only writes positions and seeds next to them into reusable staging memory
(`deepinfer.sampling.staging`) and sends it in one copy:

    bytes   | int64 [4, B]: top_k | seeds | positions | row keys | float32 [6, B]: temperature | top_p | min_p |
            | repetition | presence | frequency | bool [B]: is_greedy |

The row keys are the noise streams' keys of the random rows (`deepinfer.sampling.random.host_row_keys` of seed and
position, computed here on the host; zeros when every row is greedy).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np
import torch

from deepinfer.sampling.dense import allowed_tokens, dense_bias, dense_rows
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.random import host_keys_from_states, host_row_keys, host_seed_states
from deepinfer.sampling.seeds import as_int64
from deepinfer.sampling.staging import HostStaging

_MIN_TEMPERATURE = 1e-5
#: Requests whose RowConstants a builder keeps before it forgets all but the current batch's.
_MAX_CACHED_ROWS = 4096
_NUM_INT64, _NUM_FLOAT32 = 4, 6  # staged per row: top_k, seed, position, row key | six float stages (+ a bool byte)
_ROW_BYTES = 8 * _NUM_INT64 + 4 * _NUM_FLOAT32 + 1


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
    row_keys: torch.Tensor  # [B] int64, each row's noise key: random.row_keys(seeds, positions) (0 if all greedy)
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
        """One step's metadata, built once (a runner keeps a `SamplingMetadataBuilder`, see its `build`)."""
        return SamplingMetadataBuilder(device).build(
            params_list, positions, seeds, prompt_token_ids, output_token_ids, vocab_size,
            eos_token_ids=eos_token_ids, grammar_bitmasks=grammar_bitmasks,
        )


# RowConstants.flags: what a row needs, OR-ed (any row) and AND-ed (every row) over a batch.
GREEDY, TOP_K, TOP_P, MIN_P, PENALISED, REPEATED, BIASED, LOGPROBS, TOP_P_ALONE = (1 << i for i in range(9))
#: A row's packed constants: int64 top_k, float32 temperature, top_p, min_p, repetition, presence, frequency,
#: bool is_greedy (native order, no padding).
_RECORD = struct.Struct("=q6f?")
_RECORD_DTYPE = np.dtype([("top_k", np.int64), ("stages", np.float32, (_NUM_FLOAT32,)), ("greedy", np.uint8)])


@dataclass(slots=True)
class RowConstants:
    """What one request's SamplingParams mean to every step's sampling (for one vocab size and set of EOS ids)."""

    params: SamplingParams
    flags: int  # GREEDY | TOP_K | ...: the stages the row uses (greedy rows use none of the random ones)
    top_k: int  # vocab_size when off, and for greedy rows
    record: bytes  # _RECORD
    bias: tuple[tuple[int, float], ...]  # the user's logit_bias entries
    banned: tuple[tuple[int, float], ...]  # (stop or EOS id, -inf), sorted: added while below min_tokens
    min_tokens: int
    num_logprobs: int

    @classmethod
    def of(cls, p: SamplingParams, vocab_size: int, eos_token_ids: frozenset[int]) -> RowConstants:
        temperature, top_k, top_p, min_p = _random_stages(p, vocab_size)
        stages = (temperature, top_p, min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        greedy = p.is_greedy
        try:
            record = _RECORD.pack(top_k, *stages, greedy)
        except OverflowError:  # a finite float past float32's range: inf, as torch.tensor(..., float32) makes it
            with np.errstate(over="ignore"):
                as_float32 = np.array(stages, dtype=np.float64).astype(np.float32)
            record = _RECORD.pack(top_k, *as_float32.tolist(), greedy)
        banned: tuple[tuple[int, float], ...] = ()
        if p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            banned = tuple((t, float("-inf")) for t in sorted(ids))
        bias = tuple((p.logit_bias or {}).items())
        flags = (
            GREEDY * greedy | TOP_K * (top_k < vocab_size) | TOP_P * (top_p < 1) | MIN_P * (min_p > 0)
            | PENALISED * _uses_penalties(p) | REPEATED * (p.repetition_penalty != 1)
            | BIASED * bool(bias or banned) | LOGPROBS * bool(p.logprobs)
            | TOP_P_ALONE * (top_p < 1 and top_k >= vocab_size)
        )
        return cls(params=p, flags=flags, top_k=top_k, record=record, bias=bias, banned=banned,
                   min_tokens=p.min_tokens, num_logprobs=p.logprobs or 0)


@dataclass(slots=True)
class _BatchConstants:
    """One batch composition (the same params objects in the same order): its packed constants and host flags."""

    key: tuple[int, ...]  # id() of each row's params; `rows` holds them, so no id is reused while this lives
    rows: list[RowConstants]
    top_k_bytes: np.ndarray  # uint8 [8 B]: int64 top_k
    seed_bytes: np.ndarray | None  # uint8 [8 B]: int64 params.seed of every row; None when a row has none
    seed_states: np.ndarray | None  # uint64 [B]: random.host_seed_states of those seeds (None: none, or all greedy)
    tail_bytes: np.ndarray  # uint8 [25 B]: float32 [6, B] stages, then bool [B] is_greedy
    flags: dict[str, Any]  # SamplingMetadata's host fields
    bias_rows: list[int]  # rows with a logit_bias or ids to ban below min_tokens
    repeated_rows: list[int]
    penalised_rows: list[int]

    @classmethod
    def of(cls, key: tuple[int, ...], rows: list[RowConstants], vocab_size: int) -> _BatchConstants:
        n = len(rows)
        records = np.frombuffer(b"".join([r.record for r in rows]), dtype=_RECORD_DTYPE)
        tail = np.empty(4 * _NUM_FLOAT32 * n + n, dtype=np.uint8)
        tail[: 4 * _NUM_FLOAT32 * n].view(np.float32).reshape(_NUM_FLOAT32, n)[:] = records["stages"].T
        tail[4 * _NUM_FLOAT32 * n :] = records["greedy"]
        row_flags = [r.flags for r in rows]
        any_row, every_row = reduce(operator.or_, row_flags, 0), reduce(operator.and_, row_flags, -1)
        all_greedy = bool(every_row & GREEDY)
        flags = {
            "all_greedy": all_greedy, "any_greedy": bool(any_row & GREEDY), "any_random": not all_greedy,
            "need_top_k": bool(any_row & TOP_K), "need_top_p": bool(any_row & TOP_P),
            "need_min_p": bool(any_row & MIN_P), "need_penalties": bool(any_row & PENALISED),
            "max_top_k": max([r.top_k for r in rows if r.flags & TOP_K]) if any_row & TOP_K else 0,
            "top_p_within_top_k": not any_row & TOP_P_ALONE,
            "max_num_logprobs": min(max([r.num_logprobs for r in rows]), vocab_size) if any_row & LOGPROBS else 0,
        }
        seeds = [r.params.seed for r in rows]
        seed_bytes = None if None in seeds else _int64_column(seeds).view(np.uint8)
        seed_states = None if seed_bytes is None or all_greedy else host_seed_states(seed_bytes.view(np.int64))
        return cls(
            key=key, rows=rows, top_k_bytes=np.ascontiguousarray(records["top_k"]).view(np.uint8),
            seed_bytes=seed_bytes, seed_states=seed_states, tail_bytes=tail,
            flags=flags, bias_rows=_rows_with(rows, BIASED, any_row), repeated_rows=_rows_with(rows, REPEATED, any_row),
            penalised_rows=_rows_with(rows, PENALISED, any_row),
        )


def _int64_column(values: Sequence[int]) -> np.ndarray:
    """int64 [n] of ints in the int64 or uint64 range (a uint64 past int64's: its 64 bits, as the device holds it)."""
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array([as_int64(v) for v in values], dtype=np.int64)


def _rows_with(rows: list[RowConstants], flag: int, any_row: int) -> list[int]:
    return [i for i, r in enumerate(rows) if r.flags & flag] if any_row & flag else []


class SamplingMetadataBuilder:
    """Builds every step's SamplingMetadata on one device: RowConstants once per request, packed constants and
    flags once per batch composition, and one staged copy of the per-step columns (see the module docstring).

    A request's SamplingParams are read when it first reaches a step: they must not change afterwards (no code
    changes them; `SamplingParams.clone` makes a new object).
    """

    def __init__(self, device: torch.device | str, *, max_cached_rows: int = _MAX_CACHED_ROWS) -> None:
        self.device = torch.device(device)
        self.staging = HostStaging(self.device)
        self.max_cached_rows = max_cached_rows
        self._rows: dict[int, RowConstants] = {}  # id(params) -> its constants (which hold the params)
        self._batch: _BatchConstants | None = None
        self._vocab_size = 0
        self._eos_token_ids: frozenset[int] = frozenset()

    def build(
        self,
        params_list: Sequence[SamplingParams],
        positions: Sequence[int],
        seeds: Sequence[int] | None,
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] = (),
        grammar_bitmasks: Sequence[bytes | None] = (),
    ) -> SamplingMetadata:
        """Build one step's metadata. `seeds[i]` is `params.seed` when set, else the seed the engine drew at
        admission (`deepinfer.sampling.seeds.draw_seed`); uint64 seeds are accepted. `seeds=None`: every row's
        params carry its seed (the engine's requests do), read once per batch composition. `eos_token_ids` and
        `stop_token_ids` are banned (bias -inf) while a row has fewer than `min_tokens` output tokens.
        `grammar_bitmasks[i]`: row i's allowed next tokens from its grammar matcher (None: no grammar).
        """
        num_rows = len(params_list)
        for name, seq in (("positions", positions), ("seeds", seeds), ("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids)):
            if seq is not None and len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows, params_list has {num_rows}")
        batch = self._batch_constants(params_list, vocab_size, eos_token_ids)
        if seeds is None and batch.seed_bytes is None:
            raise ValueError("seeds=None, but a row's params have no seed")
        top_k, seeds_t, positions_t, keys_t, floats, is_greedy = self._stage(batch, positions, seeds)
        temperature, top_p, min_p, repetition, presence, frequency = floats
        prompt_mask = output_counts = None
        if batch.flags["need_penalties"]:
            repeated = {i: prompt_token_ids[i] for i in batch.repeated_rows}
            prompt_mask = dense_rows(repeated, num_rows, vocab_size, self.device, torch.bool)
            generated = {i: output_token_ids[i] for i in batch.penalised_rows}
            output_counts = dense_rows(generated, num_rows, vocab_size, self.device, torch.int32)
        return SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition,
            presence_penalty=presence, frequency_penalty=frequency, seeds=seeds_t, positions=positions_t,
            row_keys=keys_t,
            is_greedy=is_greedy, logit_bias=self._logit_bias(batch, output_token_ids, vocab_size),
            prompt_mask=prompt_mask, output_counts=output_counts,
            allowed=allowed_tokens(grammar_bitmasks, num_rows, vocab_size, self.device), vocab_size=vocab_size,
            **batch.flags,
        )

    def plain_greedy(self, params_list: Sequence[SamplingParams], vocab_size: int,
                     eos_token_ids: Sequence[int] = ()) -> bool:
        """True when `Sampler.forward` would take each row's argmax of the raw logits and nothing more (every row
        greedy; no penalties, logit bias, min_tokens ban or top logprobs): no metadata is needed for the step.
        Read from the batch composition's constants (cached, as `build` reads them)."""
        batch = self._batch_constants(params_list, vocab_size, eos_token_ids)
        flags = batch.flags
        return (flags["all_greedy"] and not flags["need_penalties"] and not batch.bias_rows
                and not flags["max_num_logprobs"])

    def _batch_constants(
        self, params_list: Sequence[SamplingParams], vocab_size: int, eos_token_ids: Sequence[int]
    ) -> _BatchConstants:
        eos = frozenset(eos_token_ids)
        if vocab_size != self._vocab_size or eos != self._eos_token_ids:  # what RowConstants were derived for
            self._rows, self._batch = {}, None
            self._vocab_size, self._eos_token_ids = vocab_size, eos
        key = tuple(map(id, params_list))
        if self._batch is not None and self._batch.key == key:
            return self._batch
        cached = self._rows
        rows = [cached.get(k) for k in key]
        for i, row in enumerate(rows):
            if row is None or row.params is not params_list[i]:
                rows[i] = self._row(params_list[i])
        self._batch = _BatchConstants.of(key, rows, vocab_size)
        if len(self._rows) > self.max_cached_rows:
            self._rows = {id(r.params): r for r in rows}
        return self._batch

    def _row(self, params: SamplingParams) -> RowConstants:
        row = self._rows.get(id(params))
        if row is None or row.params is not params:
            row = self._rows[id(params)] = RowConstants.of(params, self._vocab_size, self._eos_token_ids)
        return row

    def _stage(
        self, batch: _BatchConstants, positions: Sequence[int], seeds: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """Write the step's columns into staging memory and copy them over: (top_k, seeds, positions, row keys,
        the six float stages, is_greedy) as views of one device tensor."""
        n = len(batch.rows)
        ints_end, floats_end = 8 * _NUM_INT64 * n, (8 * _NUM_INT64 + 4 * _NUM_FLOAT32) * n
        host = self.staging.acquire(_ROW_BYTES * n)
        host[: 8 * n] = batch.top_k_bytes
        ints = host[:ints_end].view(np.int64).reshape(_NUM_INT64, n)
        if seeds is None:
            host[8 * n : 16 * n] = batch.seed_bytes
        else:
            try:
                ints[1] = seeds
            except OverflowError:  # a uint64 seed past int64's range: its 64 bits as int64, as the device holds it
                ints[1] = [as_int64(s) for s in seeds]
        ints[2] = positions
        if batch.flags["any_random"]:
            if seeds is None:  # the composition's seeds: their states were mixed once
                host_keys_from_states(batch.seed_states, ints[2], out=ints[3])
            else:
                host_row_keys(ints[1], ints[2], out=ints[3])
        else:
            ints[3] = 0
        host[ints_end:] = batch.tail_bytes
        staged = self.staging.upload(_ROW_BYTES * n)
        top_k, seeds_t, positions_t, keys_t = staged[:ints_end].view(torch.int64).view(_NUM_INT64, n).unbind(0)
        floats = staged[ints_end:floats_end].view(torch.float32).view(_NUM_FLOAT32, n).unbind(0)
        return top_k, seeds_t, positions_t, keys_t, floats, staged[floats_end:].view(torch.bool)

    def _logit_bias(
        self, batch: _BatchConstants, output_token_ids: Sequence[Sequence[int]], vocab_size: int
    ) -> torch.Tensor | None:
        """Dense [B, V] bias: the user's logit_bias, plus -inf on stop/EOS tokens for rows still below min_tokens."""
        biases: dict[int, list[tuple[int, float]]] = {}
        for row in batch.bias_rows:
            constants = batch.rows[row]
            entries = list(constants.bias)
            if len(output_token_ids[row]) < constants.min_tokens:
                entries += constants.banned
            if entries:
                biases[row] = entries
        return dense_bias(biases, len(batch.rows), vocab_size, self.device)


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
