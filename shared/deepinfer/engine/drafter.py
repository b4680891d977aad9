"""Drafters: what proposes a running sequence's next tokens for the target model to verify. No torch.

One protocol, `Drafter.propose(request, num_tokens) -> Draft`, called by EngineCore after each step's update for
every running request that decodes next; the scheduler feeds the draft with the request's last token in its next
step (k + 1 query positions) and the runner verifies it (deepinfer.sampling.rejection). A drafter that runs a model
(`BatchDrafter`, a draft model) also has `propose_batch(requests, num_tokens)`: one forward per draft position for
all requests together; EngineCore calls it instead of `propose` when a drafter has it (`propose_drafts`). A drafter
that has a distribution returns it as `Draft.probs`; one that has none (n-gram lookup, a greedy draft model) leaves it
None and is treated as one-hot. Suffix decoding is `SuffixDrafter` (engine/suffix_drafter.py), the draft model
`DraftModelDrafter` (engine/draft_model.py, built by EngineCore: it needs the target's device, dtype and KV plan),
the MTP layer `MtpDrafter` (engine/mtp_drafter.py, built by EngineCore beside the runner, whose steps it reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from deepinfer.engine.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from deepinfer.engine.request import Request


@dataclass(slots=True)
class Draft:
    """Proposed next tokens of one request, in order (may be empty), and optionally the drafter's
    distribution at each (a [len(token_ids), vocab] tensor, None = one-hot on the token)."""

    token_ids: list[int]
    probs: Any = None


NO_DRAFT = Draft([])


class Drafter(Protocol):
    """Proposes up to `num_tokens` tokens to follow a request's tokens (`request.all_token_ids`). Stateless per
    call: a drafter may keep caches keyed by request_id but must not rely on being told when a request ends."""

    #: True when drafts carry `probs` (the engine verifies them with full rejection sampling).
    has_probs: bool

    def propose(self, request: Request, num_tokens: int) -> Draft:
        """At most `num_tokens` draft tokens (fewer, or none, when the drafter has no good guess)."""
        ...


class BatchDrafter(Drafter, Protocol):
    """A drafter that proposes for many requests at once (a draft model: one forward per draft position for the
    whole batch, not per request)."""

    def propose_batch(self, requests: Sequence[Request], num_tokens: int) -> dict[str, Draft]:
        """Drafts of at most `num_tokens` tokens by request_id (a request without a guess may be absent). The
        requests are every running request that decodes next: a drafter may drop the state of any other."""
        ...


def propose_drafts(drafter: Drafter, requests: Sequence[Request], num_tokens: int) -> dict[str, list[int]]:
    """Every request's draft token ids (possibly empty), through `propose_batch` when the drafter has it."""
    propose_batch = getattr(drafter, "propose_batch", None)  # BatchDrafter
    if propose_batch is not None:
        drafts = propose_batch(requests, num_tokens)
        return {r.request_id: drafts.get(r.request_id, NO_DRAFT).token_ids for r in requests}
    return {r.request_id: drafter.propose(r, num_tokens).token_ids for r in requests}


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram` method): the longest suffix n-gram of the context, n in
    [prompt_lookup_min, prompt_lookup_max], that also occurs earlier; its earliest occurrence; the tokens that
    followed it there (up to k, fewer where the context ends).

        context  | a b c d x y b c d |          suffix 3-gram "b c d" found at 1..3
        draft                  x y b c         the k = 4 tokens after it (may run into the suffix itself)
    """

    has_probs = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, request: Request, num_tokens: int) -> Draft:
        """The draft for `request.all_token_ids` (NO_DRAFT when no n-gram of the allowed lengths recurs)."""
        return Draft(propose_ngram(request.all_token_ids, self.min_n, self.max_n, num_tokens))


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The tokens after the earliest earlier occurrence of the longest recurring suffix n-gram (module
    `NgramDrafter`); [] when none recurs or num_tokens <= 0."""
    num_context = len(token_ids)
    if num_tokens <= 0 or num_context <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_context - 1), min_n - 1, -1):
        # Windows starting at 0 .. num_context - n - 1: every n-gram but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_context - 1], n)
        hits = np.flatnonzero((windows == tokens[num_context - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start : start + num_tokens]
    return []


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter a validated config names."""
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from deepinfer.engine.suffix_drafter import SuffixDrafter  # it imports this module's Draft

        return SuffixDrafter(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                             config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    if config.method == "draft_model":
        raise ValueError("speculative_config.method='draft_model': its drafter runs a model, EngineCore builds it "
                         "(deepinfer.engine.draft_model.DraftModelDrafter.build)")
    raise ValueError(f"speculative_config.method={config.method!r} has no drafter yet")
