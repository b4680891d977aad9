"""What one scheduler step hands the runner (`SchedulerOutput` of `ScheduledRequest`s) and what it reports per
request once the step's tokens are known (`RequestUpdate`, the engine's `EngineOutput`). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.outputs import EngineOutput


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: which tokens to feed and where their KV goes."""

    request_id: str
    #: all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]; a step verifying drafts feeds
    #: the request's last token then its num_draft_tokens draft tokens (not in all_token_ids).
    token_ids: list[int]
    #: Tokens whose KV is already in the cache, before this step.
    num_computed_tokens: int
    num_new_tokens: int
    #: is_new: the request's whole block table after this step's allocation; else only the block ids appended
    #: since its last scheduled step (usually none), so a step costs O(new blocks), not O(context).
    new_block_ids: list[int]
    #: True when this step reaches the end of the known tokens, so a token is sampled (False: a prefill chunk).
    sample: bool
    #: The runner holds no state for this request (first step since admission, since resuming after preemption
    #: or since a disaggregated handoff): it (re)builds the request's block-table row from new_block_ids.
    is_new: bool
    #: Draft tokens at the end of token_ids, verified by this step (speculative decoding; 0 = none): the step
    #: samples at all of their num_draft_tokens + 1 rows (deepinfer.sampling.rejection).
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    """What one step computes; the runner drops state of preempted and finished requests before running it."""

    #: Decodes first, then prefill chunks of running requests, then newly admitted requests.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    #: Requests finished (stopped, length or aborted) since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    #: Draft tokens the step verifies, over all requests (0: a step without speculation).
    num_draft_tokens: int = 0

    @property
    def kind(self) -> str:
        """decode (every request feeds one token, and its drafts), prefill (none does), mixed (both), or empty;
        O(1) for decode."""
        num_scheduled = len(self.scheduled)
        if num_scheduled == 0:
            return "empty"
        if self.num_batched_tokens - self.num_draft_tokens == num_scheduled:
            return "decode"
        return "mixed" if any(s.num_new_tokens - s.num_draft_tokens == 1 for s in self.scheduled) else "prefill"


#: Result of a step for one request: tokens it gained and, when it ended, why. It is the EngineOutput the engine
#: hands out, built once per sampled request per step: the scheduler leaves `new_logprobs` None, and EngineCore
#: attaches the sampled token (with its logprobs) to the same object (one object per request per step, not two).
RequestUpdate = EngineOutput
