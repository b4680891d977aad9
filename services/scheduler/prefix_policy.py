"""The prefix-aware policy: each request goes where its prefix is cached, unless that worker is busier than the
cache saving is worth. Pure: the KV index is read (and touched), nothing else.

For a request of P prompt tokens, every usable worker w gets a cost in prompt tokens:

    credit(w)  = the time w's cached prefix saves it, in prompt tokens w computes in that time. The prefix is
                 KvIndex.match's runs [device | host tier | store] (the walk ends at the first block none holds).
                 From a worker reporting its measured costs (protocol 2.8): deepinfer.kv_costs' tokens_saved over
                 those runs at w's own rates, the rule w's admission applies — a device block saves block_size
                 tokens, a loaded block block_size minus the tokens w computes while it loads, and a tier slower
                 than computing saves nothing (w recomputes it).
                 From an older worker: block_size × (device blocks + LEGACY_HOST_HIT_WEIGHT × host blocks
                 + LEGACY_STORE_HIT_WEIGHT × store blocks).
    pending(w) = running + waiting (its heartbeat) + in-flight decisions not yet in it
    cost(w)    = (P − min(credit, P)) + P × (load_weight × pending(w) + kv_usage_weight × kv_usage(w))

Every term is in this prompt's tokens: the credit converts w's seconds saved at w's own prefill rate, so workers of
different speeds are compared by the share of the prompt they avoid computing, as the load terms compare them (a
request ahead costs `load_weight` of this prompt, a full KV pool `kv_usage_weight` of it). A prefix every request
carries (a system prompt) wins only while the worker holding it has fewer than credit / (load_weight × P) more
requests than the others: past that the load term wins and the prompt is computed (and then cached) elsewhere.

The decode worker is the cheapest of role decode or both; the prefill worker the cheapest of role prefill or
both with its layout. When the decode worker holds at least `direct_decode_min_fraction` of the prompt's blocks
itself (the next turn of a conversation it decoded) — or no prefill worker is usable — it computes the prompt
itself (prefill_worker_id None). Equal costs are broken at random. expected_cached_tokens = the computing worker's
cached prefix in tokens that it reuses (measured costs: the part worth loading; an older worker: all tiers), at most P.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.defaults import (
    DEFAULT_DIRECT_DECODE_MIN_FRACTION,
    DEFAULT_KV_USAGE_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
)
from deepinfer.kv_costs import DEVICE, HOST, STORE
from deepinfer.membership import Member
from deepinfer.protocol import RouteDecision, RouteRequest
from services.scheduler.kv_index import KvIndex, PrefixMatch
from services.scheduler.policy import DEFAULT_RETRY_AFTER_S, accepted, overloaded, usable_workers, worker_load

#: Credit of a host-tier / store block relative to a device block, for a worker older than protocol 2.8 (no
#: measured costs in its heartbeat): the weights every worker got before.
LEGACY_HOST_HIT_WEIGHT = 0.8
LEGACY_STORE_HIT_WEIGHT = 0.5


@dataclass(frozen=True)
class CostWeights:
    """The knobs of the cost: SchedulerSettings' fields of the same names (their meaning is described there)."""

    load_weight: float = DEFAULT_LOAD_WEIGHT
    kv_usage_weight: float = DEFAULT_KV_USAGE_WEIGHT
    direct_decode_min_fraction: float = DEFAULT_DIRECT_DECODE_MIN_FRACTION


def runs(match: PrefixMatch) -> list[tuple[str, int]]:
    """A match as deepinfer.kv_costs' runs: device blocks, then host-tier blocks, then store blocks."""
    return [(DEVICE, match.device_blocks), (HOST, match.lower_blocks), (STORE, match.store_blocks)]


def prefix_credit(member: Member, match: PrefixMatch) -> float:
    """The credit of the module docstring: the prompt tokens' worth of time the cached prefix saves `member`."""
    costs = member.kv_costs
    if costs is None:
        return member.block_size * (match.device_blocks + LEGACY_HOST_HIT_WEIGHT * match.lower_blocks
                                    + LEGACY_STORE_HIT_WEIGHT * match.store_blocks)
    return costs.tokens_saved(runs(match))


def reused_tokens(member: Member, match: PrefixMatch) -> int:
    """Tokens of the cached prefix `member` reuses: as far as loading pays at its rates (older worker: all)."""
    costs = member.kv_costs
    num_blocks = match.num_blocks if costs is None else costs.blocks_to_load(runs(match))
    return num_blocks * member.block_size


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
        self.index.touch(computing.member.worker_id, request.block_hashes[: computing.match.num_blocks])
        return accepted(request, self.scheduler_id, decode.member, None if prefill is None else prefill.member,
                        min(reused_tokens(computing.member, computing.match), request.num_prompt_tokens))

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
        credit = prefix_credit(member, match)
        load = w.load_weight * worker_load(member, in_flight) + w.kv_usage_weight * kv_usage(member)
        return num_tokens - min(credit, num_tokens) + num_tokens * load

    def _cheapest(self, scored: Sequence[Scored]) -> Scored | None:
        if not scored:
            return None
        best = min(s.cost for s in scored)
        tied = sorted((s for s in scored if s.cost == best), key=lambda s: s.member.worker_id)
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)
