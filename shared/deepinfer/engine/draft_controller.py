"""Adaptive draft length (`num_speculative_tokens: "auto"`): how many of each request's draft tokens a verify step
carries, from the request's running acceptance and the measured cost of verify steps. No torch.

    controller.observe_step(num_rows, num_query_tokens, seconds)   # after every pure decode step
    controller.observe_draft(request_id, proposed, accepted)        # after a request's draft was verified
    controller.observe_unverified(request_id, draft_token, token)   # a draft not verified, scored for free
    lengths = controller.draft_lengths({request_id: draft_len}, max_query_tokens)  # before the next step
    controller.observe_draft_round(num_rows, depth, seconds)        # a model drafter's round (draft_model)
    depth = controller.draft_depth(request_ids, max_depth, max_query_tokens)  # how deep it drafts next

Per request: `acceptance` is a moving ratio of accepted to tried draft positions (decay DECAY per observation,
starting from PRIOR_ACCEPTED / PRIOR_TRIED). A draft of d tokens with m accepted tried min(m + 1, d) positions
(after the first rejection the rest say nothing). Position i of a draft (1-based) is accepted with probability
acceptance ** i, its expected extra tokens. A draft that is not verified (the cost model cut it) is still scored on
its first token against the token the step emitted: n-gram drafts cost nothing to propose, so a request whose
acceptance fell recovers as soon as its drafts start to hit, with no verify spent on probing.

Per step: `StepCostTable` holds the measured seconds of decode steps by (rows, query tokens). With B rows and D draft
tokens chosen, the step emits B + sum of the chosen positions' expected tokens in cost(B, B + D) seconds. Draft
positions are taken in order of expected tokens (highest first, a request's positions in order) and D is the prefix
that maximises tokens per second; D = 0 (no speculation) when no prefix beats the plain step. A cell never measured
costs the straight line between the nearest measured cells of the same rows with fewer and with more tokens, or,
above the largest measured, what that one costs (optimistic: drafts are tried, their steps measured, and kept only
if they pay; the line makes one measurement of a long step price every shorter one, so a batch does not try each
length in turn: on an H200 the first version, which priced every unmeasured cell as the one below, kept trying
longer steps at c=64 and ran 0.2-0.4x of no speculation). So under load, where an extra query row costs about what
a sequence does, drafts stop by themselves; at batch 1 on a memory-bound device they are nearly free.
`max_query_tokens` caps a step's query tokens (rows + drafts) where the runner's graphs end (the full graphs sample
at most max_num_seqs rows a step; a verify step past that runs eagerly, several times slower).

A drafter that runs a model (draft_model) costs time too, before the step, whatever is verified: a round of depth d
(d draft tokens a request, one forward a position for the whole batch) is measured by rows and depth in a second
table, and `draft_depth` picks the d whose best verify step, its round's seconds added, emits the most tokens per
second: 0 (no round) when none beats the plain step. A depth never measured costs nothing extra (optimistic, as
above: it is tried, measured, and kept only if it pays). With depth 0 chosen, every PROBE_EVERY-th call still asks
for one token, so the requests' acceptance keeps being scored (an unverified draft is scored for free).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass

#: Weight kept by the older observations of a request's acceptance at each new one.
DECAY = 0.7
#: A new request's acceptance: PRIOR_ACCEPTED of PRIOR_TRIED positions (0.5, worth two observations).
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0
#: Weight of the newest measurement of a (rows, query tokens) cell.
COST_EMA_WEIGHT = 0.25
#: Draft positions whose expected tokens are below this are never verified (saves a table walk on hopeless tails).
MIN_EXPECTED_TOKENS = 0.02
#: draft_depth: with drafting not paying, one call in this many still drafts a token (acceptance stays measured).
PROBE_EVERY = 16


class StepCostTable:
    """Measured seconds of decode steps by (rows, query tokens), a moving average per cell."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int], float] = {}
        #: rows -> the query tokens measured with them, ascending
        self._by_rows: dict[int, list[int]] = {}

    def observe(self, num_rows: int, num_query_tokens: int, seconds: float) -> None:
        """A decode step of `num_rows` sequences and `num_query_tokens` tokens took `seconds`."""
        if seconds <= 0:
            return
        key = (num_rows, num_query_tokens)
        old = self.seconds.get(key)
        if old is None:
            bisect.insort(self._by_rows.setdefault(num_rows, []), num_query_tokens)
        self.seconds[key] = seconds if old is None else COST_EMA_WEIGHT * seconds + (1 - COST_EMA_WEIGHT) * old

    def cost(self, num_rows: int, num_query_tokens: int) -> float | None:
        """Seconds of such a step: its cell, else the line between the nearest measured cells of the same rows
        below and above it, else the one below (module docstring); None when no step of these rows was measured
        with at most that many tokens."""
        measured = self._by_rows.get(num_rows)
        if not measured:
            return None
        i = bisect.bisect_right(measured, num_query_tokens)
        if i == 0:
            return None
        below = measured[i - 1]
        low = self.seconds[(num_rows, below)]
        if below == num_query_tokens or i == len(measured):
            return low
        above = measured[i]
        high = self.seconds[(num_rows, above)]
        return low + (high - low) * (num_query_tokens - below) / (above - below)


@dataclass(slots=True)
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED

    def observe(self, accepted: int, tried: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


class DraftController:
    """Chooses each step's draft lengths (module docstring); one per engine, keyed by request_id."""

    def __init__(self) -> None:
        self.costs = StepCostTable()
        #: A model drafter's rounds by (rows, depth): the seconds it drafts before a step.
        self.draft_costs = StepCostTable()
        self._acceptance: dict[str, _Acceptance] = {}
        self._calls_since_probe = 0

    def acceptance(self, request_id: str) -> float:
        """The request's running acceptance per draft position (the prior for a request never seen)."""
        state = self._acceptance.get(request_id)
        return state.rate if state is not None else PRIOR_ACCEPTED / PRIOR_TRIED

    def observe_step(self, num_rows: int, num_query_tokens: int, seconds: float) -> None:
        """A pure decode step (with or without drafts) took `seconds`."""
        self.costs.observe(num_rows, num_query_tokens, seconds)

    def observe_draft_round(self, num_rows: int, depth: int, seconds: float) -> None:
        """A model drafter drafted `depth` tokens for `num_rows` requests in `seconds`."""
        self.draft_costs.observe(num_rows, depth, seconds)

    def observe_draft(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verified draft of `num_proposed` tokens had its first `num_accepted` accepted."""
        if num_proposed > 0:
            self._state(request_id).observe(num_accepted, min(num_accepted + 1, num_proposed))

    def observe_unverified(self, request_id: str, draft_token_id: int, token_id: int) -> None:
        """A draft that was not verified is scored on its first token against the token the step emitted."""
        self._state(request_id).observe(int(draft_token_id == token_id), 1)

    def retain(self, live_request_ids: Collection[str]) -> None:
        """Drop the state of requests no longer live (finished or aborted); `live_request_ids` supports `in`."""
        if len(self._acceptance) > len(live_request_ids):
            self._acceptance = {rid: a for rid, a in self._acceptance.items() if rid in live_request_ids}

    def draft_lengths(self, proposed: dict[str, int], max_query_tokens: int | None = None) -> dict[str, int]:
        """How many leading tokens of each request's proposed draft (request_id -> its length) the next step
        verifies, its rows and drafts together at most `max_query_tokens` (None: no cap); every request of the
        step's decodes is a key (0 for one without a draft)."""
        num_rows = len(proposed)
        lengths = dict.fromkeys(proposed, 0)
        plain_s = self.costs.cost(num_rows, num_rows)
        if plain_s is None:  # no plain step of this batch measured yet: measure one first
            return lengths
        positions = self._positions(proposed)
        _, best_count = self._best_prefix(positions, num_rows, num_rows / plain_s, max_query_tokens, 0.0)
        for _, _, rid in positions[:best_count]:
            lengths[rid] += 1
        return lengths

    def draft_depth(self, request_ids: Collection[str], max_depth: int, max_query_tokens: int | None = None) -> int:
        """How many tokens a model drafter drafts for these requests this round (module docstring): the depth whose
        best verify step, the round's measured seconds added, beats the plain step most; 0 = no round (but one
        token every PROBE_EVERY-th call)."""
        num_rows = len(request_ids)
        plain_s = self.costs.cost(num_rows, num_rows)
        if plain_s is None or max_depth <= 0:
            return 0
        positions = self._positions(dict.fromkeys(request_ids, max_depth))
        best_rate, best_depth = num_rows / plain_s, 0
        for depth in range(1, max_depth + 1):
            round_s = self.draft_costs.cost(num_rows, depth) or 0.0
            rate, count = self._best_prefix([p for p in positions if p[1] <= depth], num_rows, best_rate,
                                            max_query_tokens, round_s)
            if count and rate > best_rate:
                best_rate, best_depth = rate, depth
        if best_depth:
            self._calls_since_probe = 0
            return best_depth
        self._calls_since_probe += 1
        if self._calls_since_probe >= PROBE_EVERY:
            self._calls_since_probe = 0
            return 1
        return 0

    def _positions(self, proposed: dict[str, int]) -> list[tuple[float, int, str]]:
        """Every draft position (expected tokens, its index in the draft from 1, request_id), most expected first
        (stable: a request's positions stay in order, their values decrease anyway)."""
        return sorted(((self.acceptance(rid) ** i, i, rid) for rid, n in proposed.items() for i in range(1, n + 1)),
                      key=lambda p: -p[0])

    def _best_prefix(self, positions: list[tuple[float, int, str]], num_rows: int, rate_to_beat: float,
                     max_query_tokens: int | None, extra_s: float) -> tuple[float, int]:
        """(tokens per second, count) of the prefix of `positions` verified with the num_rows decodes whose step
        (plus `extra_s`) emits the most tokens per second above `rate_to_beat`; count 0 when none does."""
        best_rate, best_count = rate_to_beat, 0
        emitted = float(num_rows)
        max_drafts = len(positions) if max_query_tokens is None else max(0, max_query_tokens - num_rows)
        for count, (expected, _, _) in enumerate(positions[:max_drafts], start=1):
            if expected < MIN_EXPECTED_TOKENS:
                break
            emitted += expected
            seconds = self.costs.cost(num_rows, num_rows + count) + extra_s
            if emitted / seconds > best_rate:
                best_rate, best_count = emitted / seconds, count
        return best_rate, best_count

    def _state(self, request_id: str) -> _Acceptance:
        state = self._acceptance.get(request_id)
        if state is None:
            state = self._acceptance[request_id] = _Acceptance()
        return state
