"""`ScriptedDrafter`: a test double of `deepinfer.engine.drafter.Drafter` that proposes a known continuation.

Tests run a request once without speculation, then again with this drafter proposing that output (the target's
own tokens, so every draft is accepted), optionally wrong at every `wrong_every`-th output position, so steps
accept part of their draft and the rest is rolled back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer.engine.drafter import Draft


class ScriptedDrafter:
    """Proposes `continuations[prompt]` from the request's next output position (none for an unknown prompt);
    the draft token for output position p is wrong (token id XOR 1) when (p + 1) % wrong_every == 0."""

    has_probs = False

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], wrong_every: int = 0) -> None:
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.wrong_every = wrong_every
        #: Drafts proposed (non-empty ones), for tests that check the engine asked.
        self.num_proposed = 0

    def propose(self, request: Any, num_tokens: int) -> Draft:
        """The next `num_tokens` tokens of the known continuation, some made wrong."""
        continuation = self.continuations.get(tuple(request.prompt_token_ids))
        if continuation is None:
            return Draft([])
        start = len(request.output_token_ids)
        tokens = continuation[start : start + num_tokens]
        if self.wrong_every:
            tokens = [t ^ 1 if (start + i + 1) % self.wrong_every == 0 else t for i, t in enumerate(tokens)]
        self.num_proposed += bool(tokens)
        return Draft(tokens)
