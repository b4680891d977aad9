"""Generated tokens flowing from decode workers to gateways."""

from __future__ import annotations

from enum import StrEnum

import msgpack
from pydantic import Field, model_validator

from deepinfer.protocol.base import Message
from deepinfer.protocol.errors import ErrorDetail
from deepinfer.protocol.types import NonNegativeInt


class FinishReason(StrEnum):
    """Why a sequence ended (OpenAI's words where they exist)."""

    STOP = "stop"  # an EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the client or the gateway
    ERROR = "error"  # the worker failed; the chunk's `error` says why


class TokenLogprobs(Message):
    """Logprob of one sampled token and of the top alternatives at that position."""

    kind = "token_logprobs"

    token_id: int
    logprob: float
    #: [(token_id, logprob), ...] best first; tuples become 2-element msgpack arrays.
    top: list[tuple[int, float]] = Field(default_factory=list)


class PromptLogprobs(Message):
    """The logprobs of a prompt's own tokens (vLLM's prompt_logprobs) as parallel lists, not a model per position
    (a long prompt's scores are one message, built and read without a model per token): entry i is prompt position
    i + 1, the first token having no context. Added in 2.7."""

    kind = "prompt_logprobs"

    #: log p(prompt[i + 1] | prompt[: i + 1]) under the model's raw distribution.
    logprobs: list[float] = Field(default_factory=list)
    #: Each token's rank at its position (1 = the most likely).
    ranks: list[int] = Field(default_factory=list)
    #: The k most likely tokens at each position and their logprobs, best first (k = the request's
    #: prompt_logprobs; empty lists when it is 0).
    top_token_ids: list[list[int]] = Field(default_factory=list)
    top_logprobs: list[list[float]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _parallel(self) -> PromptLogprobs:
        n = len(self.logprobs)
        if not len(self.ranks) == len(self.top_token_ids) == len(self.top_logprobs) == n:
            raise ValueError("logprobs, ranks, top_token_ids and top_logprobs must have one entry per position")
        return self


class TokenChunk(Message):
    """The tokens one request gained since the previous chunk (a diff, never the whole output)."""

    kind = "token_chunk"

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    #: One entry per token id when logprobs were asked for.
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    #: Set on the first chunk of a request so the gateway can report cached tokens in usage.
    num_cached_tokens: NonNegativeInt | None = None
    #: With num_cached_tokens: where they came from, e.g. {"device": 512, "store": 1024} (added in 2.4).
    cached_tokens_by_tier: dict[str, NonNegativeInt] | None = None
    #: Set with finish_reason ERROR: why the worker dropped the request.
    error: ErrorDetail | None = None
    #: On the first chunk of a request that asked for prompt_logprobs, when this worker computed the prompt (2.7).
    prompt_logprobs: PromptLogprobs | None = None
    #: The request's output tokens before this chunk's (those it came with included): a gateway sees a chunk lost
    #: in transit (a NATS restart) as a gap. None: not counted (added in 2.5).
    num_previous_tokens: NonNegativeInt | None = None


class TokenBatch(Message):
    """All of one gateway's new tokens from one decode step.

    Batched because a message per token would cap a node far below its GPUs (nats-py does ~67k small
    messages/s end to end): a decode worker publishes one TokenBatch per step per gateway, carrying only the
    tokens produced since the last step (diffs).
    """

    kind = "token_batch"

    worker_id: str
    step: NonNegativeInt
    chunks: list[TokenChunk] = Field(default_factory=list)


def token_chunk_fields(
    request_id: str,
    token_ids: list[int],
    *,
    logprobs: list[TokenLogprobs] | None = None,
    finish_reason: FinishReason | None = None,
    num_cached_tokens: int | None = None,
    cached_tokens_by_tier: dict[str, int] | None = None,
    num_previous_tokens: int | None = None,
) -> dict:
    """A TokenChunk as `model_dump` gives it, built without validation: the decode worker makes one per running
    request per step, where constructing and dumping the model cost ~7 µs a chunk of its event loop (held GIL
    its engine thread waits on). The fields are the engine's own, already valid; `tests/unit` checks that
    `encode_token_batch` gives the model's bytes."""
    return {
        "v": _VERSION,
        "request_id": request_id,
        "token_ids": token_ids,
        "logprobs": None if logprobs is None else [lp.model_dump(mode="python") for lp in logprobs],
        "finish_reason": finish_reason,
        "num_cached_tokens": num_cached_tokens,
        "cached_tokens_by_tier": cached_tokens_by_tier,
        "error": None,
        "prompt_logprobs": None,
        "num_previous_tokens": num_previous_tokens,
    }


def encode_token_batch(worker_id: str, step: int, chunks: list[dict]) -> bytes:
    """The wire bytes of `TokenBatch(worker_id, step, chunks)` from `token_chunk_fields` dicts."""
    return msgpack.packb({"v": _VERSION, "worker_id": worker_id, "step": step, "chunks": chunks},
                         use_bin_type=True)


_VERSION = Message.model_fields["v"].default
