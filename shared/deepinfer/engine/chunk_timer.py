"""Prefill sized by time: a step computes about `target_s` of prompt tokens, from the measured seconds per token.
No torch.

    timer = ChunkTimer(target_s=0.5, block_size=16, max_tokens=2048)
    scheduler.max_prefill_tokens = timer.max_prefill_tokens   # before each schedule()
    timer.observe(output.num_batched_tokens, seconds)          # after each step that computed prompt tokens

A step holds the engine until it ends: an abort, a new request or a stop waits for it. On a GPU a 2048-token step
is a few ms; on a CPU it is tens of seconds (the default model on one core: ~20 ms a token), so there the token
budget alone lets one long prompt hold the worker for that long after its client left. The prompt tokens of a step
(every chunk and admission together; decodes are never cut) are then

    tokens = target_s / seconds_per_token          rounded down to whole blocks, in [block_size, max_tokens]

with seconds_per_token a moving average (half weight on the newest step) over steps of at least two blocks' tokens:
a step's fixed cost (launches, a few ms) would make a decode step's one token look slow. Later chunks of a long
prompt cost more per token (attention over a longer context); the average follows within a step or two.
"""

from __future__ import annotations

#: Weight of the newest step in the moving average.
EMA_WEIGHT = 0.5


class ChunkTimer:
    """The most prompt tokens one step may compute to take about `target_s`, from the steps measured so far."""

    def __init__(self, target_s: float, block_size: int, max_tokens: int) -> None:
        if target_s <= 0:
            raise ValueError(f"target_s must be positive, got {target_s}")
        self.target_s = target_s
        self.block_size = block_size
        self.max_tokens = max_tokens
        #: Steps with fewer tokens are not measured (their fixed cost dominates).
        self.min_sample_tokens = 2 * block_size
        self.seconds_per_token: float | None = None
        #: Before anything is measured: the smallest step that is measured (a step of 256 tokens is 5-10 s on a CPU).
        self.max_prefill_tokens = self._whole_blocks(self.min_sample_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` tokens in `seconds`: update the average and the step's prompt tokens."""
        # A step of its whole budget is measured even when that is one block: else one slow step (the first after
        # start, a loaded machine) would pin the budget at one block for good, its steps never measured again.
        if num_tokens < min(self.min_sample_tokens, self.max_prefill_tokens) or seconds <= 0:
            return
        sample = seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = sample if previous is None else EMA_WEIGHT * sample + (1 - EMA_WEIGHT) * previous
        self.max_prefill_tokens = self._whole_blocks(int(self.target_s / self.seconds_per_token))

    def _whole_blocks(self, num_tokens: int) -> int:
        whole = num_tokens // self.block_size * self.block_size
        return max(self.block_size, min(whole, self.max_tokens))
