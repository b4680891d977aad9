"""Speculative decoding's counters under vLLM's names (`vllm:spec_decode_num_drafts_total`, ...), from the engine's
`SpecDecodeStats`: `update()` (at every heartbeat of a worker that speculates) adds what changed since the last
call."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from deepinfer.engine import SpecDecodeStats

#: (vLLM's metric name, documentation, the stats' field): running totals.
_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Drafts verified (one per request per step that carried drafts).", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)


class SpecDecodeMetrics:
    """Counters of drafts, draft tokens and accepted tokens, and accepted tokens by position in the draft."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters = [(Counter(name, doc, registry=registry), field) for name, doc, field in _COUNTERS]
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by their position in the draft.", ["position"],
                                registry=registry)
        self._seen = [0] * len(self._counters)
        self._seen_per_pos: list[int] = []

    def update(self, stats: SpecDecodeStats) -> None:
        """Add the counts since the last call (the engine only ever increases them)."""
        for i, (metric, field) in enumerate(self._counters):
            value = getattr(stats, field)
            if value > self._seen[i]:
                metric.inc(value - self._seen[i])
                self._seen[i] = value
        seen = self._seen_per_pos
        for position, value in enumerate(stats.num_accepted_tokens_per_pos):
            if position == len(seen):
                seen.append(0)
                self._per_pos.labels(position=str(position))  # the series exists from its first draft on
            if value > seen[position]:
                self._per_pos.labels(position=str(position)).inc(value - seen[position])
                seen[position] = value
