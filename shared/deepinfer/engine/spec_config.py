"""`SpeculativeConfig`: vLLM's `speculative_config`, validated when the engine is built. No torch.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})

    LLM(model, speculative_config={"method": "suffix", "num_speculative_tokens": 8})   # vLLM's suffix_decoding_*

    LLM(model, speculative_config={"method": "draft_model", "model": "path/or/name", "num_speculative_tokens": 4})

    LLM(deepseek_v3, speculative_config={"method": "mtp", "num_speculative_tokens": 1})   # its MTP layer drafts

Unset (None) = no speculation, the engine exactly as without it. All four methods are implemented; `mtp` drafts one
token a step for now (engine/mtp_drafter.py: chaining the MTP layer for k > 1 is to come).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

#: Methods a config may name (vLLM's names), and those this build can run.
KNOWN_METHODS = ("ngram", "suffix", "mtp", "draft_model")
IMPLEMENTED_METHODS = ("ngram", "suffix", "draft_model", "mtp")
#: `num_speculative_tokens: "auto"`: the most draft tokens a request proposes (the controller verifies fewer).
AUTO_MAX_DRAFT_TOKENS = 8


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How a running sequence's decode steps propose and verify draft tokens (docs/speculative.md)."""

    method: str
    #: Draft tokens verified per step: an int k (always the drafter's whole draft, up to k: a step feeds k + 1
    #: query positions), or "auto" (up to AUTO_MAX_DRAFT_TOKENS, as many as pay: engine/draft_controller.py).
    #: ("suffix" only: unset = suffix_decoding_max_tree_depth, as vLLM.)
    num_speculative_tokens: int | str | None = None
    #: n-gram prompt lookup: the shortest and longest suffix n-gram matched against the context (vLLM: both
    #: default to 5 when neither is given, and either one to the other when only one is).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    #: Suffix decoding (engine/suffix_drafter.py), vLLM's names and defaults: the suffix trees' depth (a match and
    #: its draft together), retired requests kept in the global tree (0 = none; 1,000 rather than vLLM's 10,000:
    #: our Python tree holds ~700 bytes a token, so 10,000 requests of ~300 tokens would be ~2 GB of host memory),
    #: the most draft tokens per matched token, and the probability below which a draft stops.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    #: "draft_model" only (required there): the draft checkpoint, a Hugging Face directory, a .gguf file or a known
    #: name, resolved as the target's `model` is (engine/draft_model.py).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in KNOWN_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(KNOWN_METHODS)}, "
                             f"got {self.method!r}")
        if self.method not in IMPLEMENTED_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not implemented yet "
                             f"(implemented: {', '.join(IMPLEMENTED_METHODS)})")
        _check_suffix_decoding(self)
        _check_model(self)
        k = self.num_speculative_tokens
        if k is None and self.method == "suffix":
            k = self.suffix_decoding_max_tree_depth
            object.__setattr__(self, "num_speculative_tokens", k)
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int >= 1 or \"auto\", got {k!r}")
        if self.method == "mtp" and k not in (1, "auto"):
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r}: method 'mtp' drafts one token a step "
                             "for now (1 or \"auto\"; chaining its MTP layer for more is to come)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def adaptive(self) -> bool:
        """True with `num_speculative_tokens: "auto"`: draft lengths follow acceptance and measured step cost."""
        return self.num_speculative_tokens == "auto"

    @property
    def max_num_draft_tokens(self) -> int:
        """The most draft tokens one request proposes per step."""
        if self.method == "mtp":
            return 1
        return AUTO_MAX_DRAFT_TOKENS if self.adaptive else self.num_speculative_tokens

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """The config from vLLM's dict form (or as given); None stays None. ValueError names an unknown key, a
        missing one or a bad value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {', '.join(sorted(known))})")
        required = ("method",) if value.get("method") == "suffix" else ("method", "num_speculative_tokens")
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f"speculative_config: missing {', '.join(missing)}")
        return cls(**value)


def _check_model(config: SpeculativeConfig) -> None:
    """ValueError when "draft_model" has no `model`, or another method has one."""
    model = config.model
    if config.method == "draft_model":
        if isinstance(model, os.PathLike):
            object.__setattr__(config, "model", model := os.fspath(model))
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model is required with method 'draft_model': the draft checkpoint "
                             f"(a model directory, .gguf file or known name), got {model!r}")
    elif model is not None:
        raise ValueError(f"speculative_config.model is only for method 'draft_model', not {config.method!r}")


def _check_suffix_decoding(config: SpeculativeConfig) -> None:
    """ValueError naming the first suffix_decoding_* setting out of range (checked whatever the method)."""
    checks = (
        ("suffix_decoding_max_tree_depth", "an int >= 1", True, lambda v: v >= 1),
        ("suffix_decoding_max_cached_requests", "an int >= 0", True, lambda v: v >= 0),
        ("suffix_decoding_max_spec_factor", "a number > 0", False, lambda v: v > 0),
        ("suffix_decoding_min_token_prob", "a number in [0, 1]", False, lambda v: 0 <= v <= 1),
    )
    for name, what, integral, in_range in checks:
        value = getattr(config, name)
        kind_ok = isinstance(value, int) if integral else isinstance(value, int | float)
        if isinstance(value, bool) or not kind_ok or not in_range(value):
            raise ValueError(f"speculative_config.{name} must be {what}, got {value!r}")
