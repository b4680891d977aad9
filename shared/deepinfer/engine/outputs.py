"""What the engine hands out, torch-free: per-step `EngineOutput`s, load `EngineStats`, and the offline API's
vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from deepinfer.protocol import FinishReason


@dataclass(slots=True)
class SampledToken:
    """One sampled token with its raw logprob and, when asked, the top logprobs of that position (not frozen: one
    is built per sampled request per step, and a frozen dataclass's __init__ costs 3-4x)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """The log-probabilities of a prompt's own tokens under the model's raw distribution (vLLM's prompt_logprobs),
    as parallel lists: entry i is prompt position i + 1 (the first token has no context, so no entry).

        prompt        | t0 | t1 | t2 | ... | t_{P-1} |
        entry         |    | 0  | 1  | ... | P-2     |   logprobs[i] = log p(t_{i+1} | t_0 .. t_i)
    """

    logprobs: list[float] = field(default_factory=list)  # [P-1]
    #: Each token's rank in its position's distribution (1 = the most likely).
    ranks: list[int] = field(default_factory=list)  # [P-1]
    #: The request's `prompt_logprobs` = k most likely tokens at each position, best first ([] when k = 0).
    top_token_ids: list[list[int]] = field(default_factory=list)  # [P-1][k]
    top_logprobs: list[list[float]] = field(default_factory=list)  # [P-1][k]

    def __len__(self) -> int:
        return len(self.logprobs)


@dataclass(slots=True)
class EngineOutput:
    """What one step produced for one request: new tokens (with logprobs when asked) and how it ended (slotted:
    the engine builds one per sampled request per step)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_cached_tokens: int
    #: time.monotonic() when the scheduler first gave the request a step (queue wait ends, compute begins).
    first_scheduled_time: float | None = None
    #: Of num_cached_tokens, those loaded from the kvcache store.
    num_store_cached_tokens: int = 0
    #: Of num_cached_tokens, those loaded from the worker's host-memory tier.
    num_host_cached_tokens: int = 0
    #: A request asking for prompt_logprobs: its prompt's, on the output that carries its first token.
    prompt_logprobs: PromptLogprobs | None = None


class EngineStats(NamedTuple):
    """Load numbers for heartbeats and gauges (a tuple: cheap enough to take after every engine step)."""

    num_running: int
    num_waiting: int
    num_held: int
    num_free_blocks: int
    num_total_blocks: int
    #: Requests admitted since start (a monotonic count).
    num_added: int = 0


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution, with its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One dict per generated token: token id → Logprob (the sampled token plus the top-k asked for).
SampleLogprobs = list[dict[int, Logprob]]
#: vLLM's prompt_logprobs: None for the first prompt token, then one dict per token (it and the top-k).
PromptLogprobDicts = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has several)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    #: The stop string or stop token id that ended the sequence, if any.
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: its token ids and the generated sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    #: Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    finished: bool = False
    #: SamplingParams.prompt_logprobs asked: the prompt's (vLLM's shape).
    prompt_logprobs: PromptLogprobDicts | None = None
