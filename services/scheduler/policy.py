"""Routing policy: which (prefill, decode) pair serves a request, or "overloaded".

A small strategy object behind the `RoutingPolicy` protocol, so that the prefix-aware policy (cost = prompt
tokens left after cached-prefix credit + decode load, docs/architecture.md §6) replaces `LeastLoadedPolicy` without
touching the handler.

Rules of `LeastLoadedPolicy` (docs/services.md has the same list):
- load of a worker = num_running + num_waiting (from its latest heartbeat) + in-flight decisions that the
  heartbeat does not show yet; least load wins, ties go to fewer running, then to a random one;
- never a draining worker, never a worker whose model_fingerprint differs from the request's (a request
  without a fingerprint matches any worker);
- a worker is *saturated* when it reports a KV pool (num_total_blocks > 0) with no free block left
  (num_free_blocks == 0): a full pool is what makes a new request wait (max_num_seqs, also in the
  heartbeat, is left to the prefix-aware policy's admission);
- decode: least loaded unsaturated worker of role decode or both; none → OVERLOADED with retry_after_s;
- prefill: least loaded unsaturated worker of role prefill or both whose layout_id equals the decode worker's
  (KV moves between them); none, or the decode worker itself → prefill_worker_id None (decode computes
  the prompt);
- expected_cached_tokens is 0 (the prefix-aware policy fills it);
- workers in the request's exclude_worker_ids (a migrated request's lost worker) are left out while another
  decode worker can take the request; otherwise they are candidates like the others.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.membership import Member
from deepinfer.protocol import RouteDecision, RouteRequest, RouteStatus

#: Seconds a client is told to wait before retrying an overloaded request.
DEFAULT_RETRY_AFTER_S = 1.0


class RoutingPolicy(Protocol):
    """Chooses the workers of one request from the live members and the in-flight counts."""

    def pick(
        self, request: RouteRequest, members: Sequence[Member], in_flight: Mapping[str, int]
    ) -> RouteDecision:
        """The decision for `request`; `in_flight` maps worker_id -> decisions not yet in its heartbeat."""
        ...


def worker_load(member: Member, in_flight: Mapping[str, int]) -> int:
    """Requests on a worker: running + waiting per its heartbeat + in-flight decisions not yet in it."""
    return member.num_running + member.num_waiting + in_flight.get(member.worker_id, 0)


def is_saturated(member: Member) -> bool:
    """A worker whose KV pool is known and full: a new request would only wait there."""
    return member.num_total_blocks > 0 and member.num_free_blocks == 0


def serves_model(member: Member, request: RouteRequest) -> bool:
    """Whether `member` runs the exact model the request was tokenized and hashed for."""
    return request.model_fingerprint is None or member.model_fingerprint == request.model_fingerprint


@dataclass
class LeastLoadedPolicy:
    """Least-loaded prefill and decode workers, with admission; see the module docstring for the rules."""

    scheduler_id: str
    #: Breaks ties between equally loaded workers; seed it in tests.
    rng: random.Random = field(default_factory=random.Random)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S

    def pick(
        self, request: RouteRequest, members: Sequence[Member], in_flight: Mapping[str, int]
    ) -> RouteDecision:
        """The least-loaded pair for `request`, or OVERLOADED when no decode worker can take it."""
        usable = usable_workers(request, members)
        decode = self.least_loaded([m for m in usable if m.can_decode], in_flight)
        if decode is None:
            return overloaded(request, self.scheduler_id, self.retry_after_s)
        prefill = self.least_loaded(
            [m for m in usable if m.can_prefill and m.layout_id == decode.layout_id], in_flight
        )
        return accepted(request, self.scheduler_id, decode, prefill)

    def least_loaded(self, candidates: Sequence[Member], in_flight: Mapping[str, int]) -> Member | None:
        """The candidate with the least load, then the fewest running, then a random one; None if empty."""
        if not candidates:
            return None
        keyed = [((worker_load(m, in_flight), m.num_running), m) for m in candidates]
        best = min(key for key, _ in keyed)
        tied = sorted((m for key, m in keyed if key == best), key=lambda m: m.worker_id)
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)


def overloaded(request: RouteRequest, scheduler_id: str, retry_after_s: float) -> RouteDecision:
    """The OVERLOADED answer: no decode worker can take the request now."""
    return RouteDecision(
        request_id=request.request_id,
        status=RouteStatus.OVERLOADED,
        retry_after_s=retry_after_s,
        scheduler_id=scheduler_id,
    )


def accepted(
    request: RouteRequest, scheduler_id: str, decode: Member, prefill: Member | None, expected_cached_tokens: int = 0
) -> RouteDecision:
    """The ACCEPTED answer; no separate prefill when there is none or it is the decode worker itself."""
    skip_prefill = prefill is None or prefill.worker_id == decode.worker_id
    return RouteDecision(
        request_id=request.request_id,
        status=RouteStatus.ACCEPTED,
        prefill_worker_id=None if skip_prefill else prefill.worker_id,
        decode_worker_id=decode.worker_id,
        expected_cached_tokens=expected_cached_tokens,
        scheduler_id=scheduler_id,
    )


def usable_workers(request: RouteRequest, members: Sequence[Member]) -> list[Member]:
    """Members a request may go to: not draining, not saturated, serving its model; not one of the request's
    exclude_worker_ids (a re-issued request's lost workers) while another decode worker can take it."""
    usable = [m for m in members if not m.draining and not is_saturated(m) and serves_model(m, request)]
    preferred = [m for m in usable if m.worker_id not in request.exclude_worker_ids]
    return preferred if any(m.can_decode for m in preferred) else usable


@dataclass
class RoundRobinPolicy:
    """Decode workers in turn, then the prefill workers of its layout in turn (worker_id order); a baseline for
    benchmarks. The usable set and OVERLOADED are as in LeastLoadedPolicy."""

    scheduler_id: str
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    _turns: dict[str, int] = field(default_factory=dict)

    def pick(
        self, request: RouteRequest, members: Sequence[Member], in_flight: Mapping[str, int]
    ) -> RouteDecision:
        """The next decode worker and the next prefill worker of its layout."""
        usable = usable_workers(request, members)
        decode = self._next("decode", [m for m in usable if m.can_decode])
        if decode is None:
            return overloaded(request, self.scheduler_id, self.retry_after_s)
        prefill = self._next("prefill", [m for m in usable if m.can_prefill and m.layout_id == decode.layout_id])
        return accepted(request, self.scheduler_id, decode, prefill)

    def _next(self, side: str, candidates: Sequence[Member]) -> Member | None:
        if not candidates:
            return None
        turn = self._turns.get(side, 0)
        self._turns[side] = turn + 1
        return candidates[turn % len(candidates)]  # members() comes sorted by worker_id
