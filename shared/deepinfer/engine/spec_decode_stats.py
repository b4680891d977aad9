"""Acceptance counters of speculative decoding, under vLLM's metric names (`vllm:spec_decode_num_drafts`, ...).
No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts since the engine started: drafts verified, their tokens, those accepted (in total and by position
    in the draft). Acceptance counts a draft token the target agreed with, whether or not a stop after it cut
    the emitted tokens short."""

    #: Requests' drafts verified (one per request per step that carried drafts).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: [k]: entry i = drafts whose token i was accepted (so every earlier one was too).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verified draft: k tokens proposed, the first m accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft, the target's own token included (1 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
