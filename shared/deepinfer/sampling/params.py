"""`SamplingParams`: what a request asks of the sampler. Plain Python: no torch, no pydantic.

Field names and defaults follow vLLM's `SamplingParams`; the wire message (`deepinfer.protocol.WireSamplingParams`)
uses the same names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
_INT64_MIN = -(2**63)
_INT64_END = 2**63
_UINT64_END = 2**64
#: Longest shown value in an error message (a hostile 1 MB stop string is not echoed back).
_MAX_SHOWN = 80


class SamplingParamError(ValueError):
    """A sampling field with a bad value; `param` names the field (the gateway's 400 names it too)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM names and defaults; validated on construction).

    `seed=None` means "no reproducibility asked": the engine draws a seed at admission (`deepinfer.sampling.seeds`)
    and passes it explicitly, so prefill, decode and a migrated decode still draw the same tokens.
    Treat an instance as frozen once a request holds it: the runner derives its per-step sampling constants from
    it once (`deepinfer.sampling.metadata.SamplingMetadataBuilder`); `clone` gives a changed copy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the sampled token's only; k: plus the top k
    #: vLLM's prompt_logprobs: None off; k: the logprob (and rank) of each prompt token after the first, plus the
    #: top k at its position. The engine computes every prompt position for them (no prefix-cache reuse).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: llguidance grammar text (`deepinfer.structured`): only tokens it allows are sampled; None = free text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_token_ids(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        _validate(self)

    @property
    def is_greedy(self) -> bool:
        """True when the request always takes the most likely token (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied; lists and dicts are not shared with the original."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_generation_config(cls, gen_cfg: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Params whose defaults come from a HF `generation_config.json`, then `overrides` on top.

        Read: `generation_sampling` (temperature, top_p, top_k, min_p, repetition_penalty; `do_sample: false`
        means greedy), max_new_tokens (→ max_tokens).
        """
        defaults: dict[str, Any] = dict(generation_sampling(gen_cfg))
        if gen_cfg.get("max_new_tokens") is not None:
            defaults["max_tokens"] = gen_cfg["max_new_tokens"]
        return cls(**{**defaults, **overrides})


#: generation_config.json keys that are sampling defaults, as vLLM reads them (SamplingParams' names).
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling(gen_cfg: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a `generation_config.json` recommends: GENERATION_SAMPLING_KEYS that are set, and
    temperature 0 for `do_sample: false` (an absent `do_sample` is not read as greedy; vLLM does the same)."""
    defaults = {key: gen_cfg[key] for key in GENERATION_SAMPLING_KEYS if gen_cfg.get(key) is not None}
    if gen_cfg.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def _normalise_stop(stop: list[str] | str | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _normalise_token_ids(token_ids: list[int] | None) -> list[int]:
    if token_ids is None:
        return []
    _check(all(_is_int(t) for t in token_ids), "stop_token_ids", "a list of integer token ids", token_ids)
    return list(token_ids)


def _normalise_logit_bias(logit_bias: dict[Any, float]) -> dict[int, float]:
    try:
        # JSON object keys arrive as strings ({"50256": -100}).
        return {int(token_id): float(bias) for token_id, bias in logit_bias.items()}
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise SamplingParamError(
            "logit_bias", f"logit_bias must map token ids to numbers, got {_shown(logit_bias)}"
        ) from exc


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """SamplingParamError unless every token id the params name (logit_bias keys, stop_token_ids) is in
    [0, vocab_size): the gateway and the engine run this same check, so a request fails before routing."""
    for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise SamplingParamError(name, f"{name}: token id {_shown(bad)} is outside the vocabulary [0, {vocab_size})")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}... ({len(text)} characters)"


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise SamplingParamError(name, f"{name} must be {rule}, got {_shown(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(p: SamplingParams) -> None:
    _check(_is_int(p.n) and p.n >= 1, "n", "an integer >= 1", p.n)
    _check(_is_number(p.temperature) and p.temperature >= 0, "temperature", "a finite number >= 0", p.temperature)
    _check(_is_number(p.top_p) and 0 < p.top_p <= 1, "top_p", "in (0, 1]", p.top_p)
    _check(_is_int(p.top_k) and -1 <= p.top_k < _INT64_END, "top_k", "an int64 >= -1 (0 or -1: off)", p.top_k)
    _check(_is_number(p.min_p) and 0 <= p.min_p <= 1, "min_p", "in [0, 1]", p.min_p)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
    _check(
        _is_number(p.repetition_penalty) and p.repetition_penalty > 0,
        "repetition_penalty", "a finite number > 0", p.repetition_penalty,
    )
    if p.max_tokens is not None:
        _check(_is_int(p.max_tokens) and 1 <= p.max_tokens < _INT64_END, "max_tokens", "an int64 >= 1 or None",
               p.max_tokens)
    _check(_is_int(p.min_tokens) and 0 <= p.min_tokens < _INT64_END, "min_tokens", "an int64 >= 0", p.min_tokens)
    if p.max_tokens is not None:
        _check(p.min_tokens <= p.max_tokens, "min_tokens", f"<= max_tokens ({p.max_tokens})", p.min_tokens)
    if p.logprobs is not None:
        _check(
            _is_int(p.logprobs) and 0 <= p.logprobs <= MAX_LOGPROBS,
            "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", p.logprobs,
        )
    if p.prompt_logprobs is not None:
        _check(
            _is_int(p.prompt_logprobs) and 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", p.prompt_logprobs,
        )
    if p.seed is not None:
        _check(
            _is_int(p.seed) and _INT64_MIN <= p.seed < _UINT64_END,
            "seed", "None or an integer in the int64 or uint64 range", p.seed,
        )
    _check(all(isinstance(s, str) and s for s in p.stop), "stop", "a string or a list of non-empty strings", p.stop)
    _check(p.grammar is None or (isinstance(p.grammar, str) and p.grammar != ""), "grammar",
           "None or a non-empty grammar string", p.grammar)
    _check(all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "non-negative token ids", p.stop_token_ids)
    if p.logit_bias is not None:
        _check(all(t >= 0 for t in p.logit_bias), "logit_bias", "keyed by non-negative token ids", p.logit_bias)
        _check(all(math.isfinite(b) for b in p.logit_bias.values()), "logit_bias", "finite biases", p.logit_bias)
