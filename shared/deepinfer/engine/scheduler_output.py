"""What one scheduler step hands the runner (`SchedulerOutput` of `ScheduledRequest`s) and what it reports per
request once the step's tokens are known (`RequestUpdate`). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.protocol import FinishReason


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: which tokens to feed and where their KV goes."""

    request_id: str
    #: all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
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


@dataclass
class SchedulerOutput:
    """What one step computes; the runner drops state of preempted and finished requests before running it."""

    #: Decodes first, then prefill chunks of running requests, then newly admitted requests.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    #: Requests finished (stopped, length or aborted) since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0


@dataclass(slots=True)
class RequestUpdate:
    """Result of a step for one request: tokens it gained and, when it ended, why (not frozen: a frozen
    dataclass's __init__ costs 4x, and the scheduler builds one per sampled request per step)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    #: The stop token id that ended the request, if one did.
    stop_reason: int | None = None
    #: Request.first_scheduled_time (time.monotonic()), for the queue / compute split of a request's latency.
    first_scheduled_time: float | None = None
    #: Of num_cached_tokens, those loaded from the kvcache store.
    num_store_cached_tokens: int = 0
    #: Of num_cached_tokens, those loaded from the worker's host-memory tier.
    num_host_cached_tokens: int = 0
