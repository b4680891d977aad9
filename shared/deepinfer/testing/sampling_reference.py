"""The sampling metadata build as it was before `SamplingMetadataBuilder` (every row's params read every step,
two torch.tensor copies): the reference the builder's output is compared with, field by field, and random
mixed batches to compare on. Used by the builder's tests and by bench/gpu/sampling_metadata_cost.py."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.random import row_keys
from deepinfer.sampling.seeds import as_int64

_MIN_TEMPERATURE = 1e-5


def reference_build(
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
    return SamplingMetadata(
        temperature=temperature_t, top_k=top_k_t, top_p=top_p_t, min_p=min_p_t, repetition_penalty=rep,
        presence_penalty=presence, frequency_penalty=frequency, seeds=seeds_t, positions=positions_t,
        # The noise keys by the device's own arithmetic (the builder computes them on the host).
        row_keys=torch.zeros_like(seeds_t) if all(greedy) else row_keys(seeds_t, positions_t),
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


@dataclass
class Step:
    """One step's build arguments (the device aside)."""

    params_list: list[SamplingParams]
    positions: list[int]
    seeds: list[int]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    grammar_bitmasks: list[bytes | None] = field(default_factory=list)

    def kwargs(self) -> dict:
        return {"eos_token_ids": self.eos_token_ids, "grammar_bitmasks": self.grammar_bitmasks}

    def args(self) -> tuple:
        return (self.params_list, self.positions, self.seeds, self.prompt_token_ids, self.output_token_ids,
                self.vocab_size)


def random_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    """Greedy (temperature 0 or top_k 1), plain random, top-k / top-p / min-p in any mix, penalties, logit_bias,
    min_tokens with stop ids, logprobs, int64 / uint64 seeds, temperatures past float32's range."""
    kind = rng.choice(["greedy", "greedy", "top_k_1", "random", "filters", "filters", "penalties", "bias", "min"])
    kw: dict = {"seed": rng.choice([rng.randrange(2**63), rng.randrange(2**63, 2**64), -rng.randrange(2**63)])}
    if kind == "greedy":
        kw["temperature"] = 0.0
    elif kind == "top_k_1":
        kw["top_k"] = 1
    else:
        kw["temperature"] = rng.choice([0.7, 1.0, 1e-7, 3.3, 1e300])
    if kind == "filters":
        kw["top_k"] = rng.choice([0, -1, 5, 50, vocab_size, vocab_size + 7])
        kw["top_p"] = rng.choice([1.0, 0.9, 0.5])
        kw["min_p"] = rng.choice([0.0, 0.05])
    if kind == "penalties" or rng.random() < 0.1:
        kw["repetition_penalty"] = rng.choice([1.0, 1.2, 0.8])
        kw["presence_penalty"] = rng.choice([0.0, 0.5, -1.0])
        kw["frequency_penalty"] = rng.choice([0.0, 0.3])
    if kind == "bias" or rng.random() < 0.1:
        kw["logit_bias"] = {rng.randrange(vocab_size): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
    if kind == "min" or rng.random() < 0.1:
        kw["min_tokens"] = rng.randrange(1, 6)
        kw["stop_token_ids"] = rng.sample(range(vocab_size), rng.randrange(0, 3))
        kw["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randrange(0, 21)
    return SamplingParams(**kw)


def random_bitmask(rng: random.Random, vocab_size: int) -> bytes:
    """A grammar bitmask over at most vocab_size ids (sometimes fewer words: a tokenizer narrower than the model)."""
    num_words = max(1, -(-vocab_size // 32) - rng.randrange(2))
    return bytes(rng.randrange(256) for _ in range(4 * num_words))


def random_step(
    rng: random.Random, params_list: list[SamplingParams], vocab_size: int, eos_token_ids: list[int],
    *, grammar: bool = False,
) -> Step:
    """Build arguments for `params_list` with random positions, prompts and outputs (some below min_tokens)."""
    n = len(params_list)
    outputs = [[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 8))] for _ in range(n)]
    return Step(
        params_list=params_list,
        positions=[rng.randrange(1, 4096) for _ in range(n)],
        seeds=[p.seed for p in params_list],
        prompt_token_ids=[[rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(n)],
        output_token_ids=outputs,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        grammar_bitmasks=[random_bitmask(rng, vocab_size) if grammar and rng.random() < 0.5 else None
                          for _ in range(n)],
    )


def metadata_differences(got: SamplingMetadata, want: SamplingMetadata) -> list[str]:
    """The fields where `got` differs from `want` (dtype, shape or any element; host flags by value)."""
    diffs = []
    for f in fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
            )
        else:
            same = a == b and type(a) is type(b)
        if not same:
            diffs.append(f"{f.name}: {a!r} != {b!r}")
    return diffs
