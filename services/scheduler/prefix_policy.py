"""The prefix-aware policy: each request goes where its prefix is cached, unless that worker is busier than the
cache saving is worth. Pure: the KV index is read (and touched), nothing else.

For a request of P prompt tokens, every usable worker w gets a cost in prompt tokens:

    credit(w)  = block_size × (device blocks + host_hit_weight × lower-tier blocks
                                + store_hit_weight × store blocks)
                 of w's cached prefix (KvIndex.match: the walk ends at the first block none of them holds)
    pending(w) = running + waiting (its heartbeat) + in-flight decisions not yet in it
    cost(w)    = (P − min(credit, P)) + P × (load_weight × pending(w) + kv_usage_weight × kv_usage(w))

so a request ahead costs `load_weight` of this prompt and a full KV pool `kv_usage_weight` of it. A prefix every
request carries (a system prompt) wins only while the worker holding it has fewer than saving / (load_weight × P)
more requests than the others: past that the load term wins and the prompt is computed (and then cached) elsewhere.

The decode worker is the cheapest of role decode or both; the prefill worker the cheapest of role prefill or
both with its layout. When the decode worker holds at least `direct_decode_min_fraction` of the prompt's blocks
itself (the next turn of a conversation it decoded) — or no prefill worker is usable — it computes the prompt
itself (prefill_worker_id None). Equal costs are broken at random. expected_cached_tokens = the computing worker's
cached prefix in tokens (all tiers), at most P.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.defaults import (
    DEFAULT_DIRECT_DECODE_MIN_FRACTION,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_KV_USAGE_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_STORE_HIT_WEIGHT,
)
from deepinfer.membership import Member
from deepinfer.protocol import RouteDecision, RouteRequest
from services.scheduler.kv_index import KvIndex, PrefixMatch
from services.scheduler.policy import DEFAULT_RETRY_AFTER_S, accepted, overloaded, usable_workers, worker_load


@dataclass(frozen=True)
class CostWeights:
    """The knobs of the cost: SchedulerSettings' fields of the same names (their meaning is described there)."""

    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT
    store_hit_weight: float = DEFAULT_STORE_HIT_WEIGHT
    load_weight: float = DEFAULT_LOAD_WEIGHT
    kv_usage_weight: float = DEFAULT_KV_USAGE_WEIGHT
    direct_decode_min_fraction: float = DEFAULT_DIRECT_DECODE_MIN_FRACTION


def kv_usage(member: Member) -> float:
    """Fraction of the worker's KV pool in use (0 while it has not reported one)."""
    if member.num_total_blocks <= 0:
        return 0.0
    return 1.0 - member.num_free_blocks / member.num_total_blocks


@dataclass
class Scored:
    """One candidate's cost and what it would reuse."""

    member: Member
    match: PrefixMatch
    cost: float


@dataclass
class PrefixPolicy:
    """Cost-based routing over the KV index; see the module docstring."""

    scheduler_id: str
    index: KvIndex
    weights: CostWeights = field(default_factory=CostWeights)
    rng: random.Random = field(default_factory=random.Random)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S

    def pick(
        self, request: RouteRequest, members: Sequence[Member], in_flight: Mapping[str, int]
    ) -> RouteDecision:
        """The cheapest (prefill, decode) pair, or OVERLOADED when no decode worker can take it."""
        usable = usable_workers(request, members)
        scored = self.score(request, usable, in_flight)
        decode = self._cheapest([s for s in scored if s.member.can_decode])
        if decode is None:
            return overloaded(request, self.scheduler_id, self.retry_after_s)
        prefill = self._cheapest(
            [s for s in scored if s.member.can_prefill and s.member.layout_id == decode.member.layout_id]
        )
        num_blocks = len(request.block_hashes)
        own_blocks = decode.match.device_blocks + decode.match.lower_blocks
        direct = num_blocks > 0 and own_blocks >= self.weights.direct_decode_min_fraction * num_blocks
        if prefill is None or direct or prefill.member.worker_id == decode.member.worker_id:
            prefill = None
        computing = decode if prefill is None else prefill
        block_size = computing.member.block_size
        self.index.touch(computing.member.worker_id, request.block_hashes[: computing.match.num_blocks])
        return accepted(request, self.scheduler_id, decode.member, None if prefill is None else prefill.member,
                        min(computing.match.num_blocks * block_size, request.num_prompt_tokens))

    def score(
        self, request: RouteRequest, candidates: Sequence[Member], in_flight: Mapping[str, int]
    ) -> list[Scored]:
        """Every candidate's cost (module docstring), its prefix matched per layout."""
        by_layout: dict[str, list[Member]] = {}
        for member in candidates:
            by_layout.setdefault(member.layout_id, []).append(member)
        matches: dict[str, PrefixMatch] = {}
        for layout_id, group in by_layout.items():
            matches.update(self.index.match(layout_id, request.block_hashes, [m.worker_id for m in group]))
        return [Scored(m, matches[m.worker_id], self.cost(request, m, matches[m.worker_id], in_flight))
                for m in candidates]

    def cost(self, request: RouteRequest, member: Member, match: PrefixMatch, in_flight: Mapping[str, int]) -> float:
        """Prompt tokens left to compute after the cached-prefix credit, plus the load term, in tokens."""
        w, num_tokens = self.weights, request.num_prompt_tokens
        credit = member.block_size * (
            match.device_blocks + w.host_hit_weight * match.lower_blocks + w.store_hit_weight * match.store_blocks
        )
        load = w.load_weight * worker_load(member, in_flight) + w.kv_usage_weight * kv_usage(member)
        return num_tokens - min(credit, num_tokens) + num_tokens * load

    def _cheapest(self, scored: Sequence[Scored]) -> Scored | None:
        if not scored:
            return None
        best = min(s.cost for s in scored)
        tied = sorted((s for s in scored if s.cost == best), key=lambda s: s.member.worker_id)
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)
