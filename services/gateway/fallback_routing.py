"""Fail-open routing: when no scheduler answers, the gateway picks the workers itself from its heartbeat table.

    router = FallbackRouter(membership, gateway_id)
    decision = router.route(route_request)     # the scheduler's least-loaded rules over this gateway's members

The gateway follows every worker's heartbeats (membership), so it can route without a scheduler: the rules are the
scheduler's `LeastLoadedPolicy` (least running + waiting, never draining, saturated or of another model; a prefill
worker of the decode worker's layout), without the prefix-cache credit only a scheduler's KV index gives. Load it
does not see yet (its own decisions since a worker's last heartbeat) is counted here, so a burst spreads out.
A scheduler that answers is always preferred; this runs only while none does (`RequestPipeline.route`).
"""

from __future__ import annotations

from deepinfer.membership import Membership
from deepinfer.protocol import RouteDecision, RouteRequest
from services.scheduler.policy import LeastLoadedPolicy


class FallbackRouter:
    """Least-loaded routing over one gateway's membership table."""

    def __init__(self, membership: Membership, gateway_id: str) -> None:
        self.membership = membership
        self.policy = LeastLoadedPolicy(scheduler_id=gateway_id)
        #: worker_id -> (last_seen_s of the heartbeat the count is on top of, decisions made since it).
        self._in_flight: dict[str, tuple[float, int]] = {}

    def route(self, request: RouteRequest) -> RouteDecision:
        """A decision (ACCEPTED, or OVERLOADED when no live decode worker can take the request)."""
        members = self.membership.members()
        in_flight = {}
        for member in members:
            counted = self._in_flight.get(member.worker_id)
            if counted is not None and counted[0] == member.last_seen_s:
                in_flight[member.worker_id] = counted[1]
        decision = self.policy.pick(request, members, in_flight)
        seen = {m.worker_id: m.last_seen_s for m in members}
        for worker_id in (decision.prefill_worker_id, decision.decode_worker_id):
            if worker_id is not None:
                self._in_flight[worker_id] = (seen[worker_id], in_flight.get(worker_id, 0) + 1)
                in_flight[worker_id] = self._in_flight[worker_id][1]
        for worker_id in [w for w in self._in_flight if w not in seen]:  # bounded by the live members
            del self._in_flight[worker_id]
        return decision
