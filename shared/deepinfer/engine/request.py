"""The engine's view of one sequence: its tokens, progress through the KV cache and lifecycle status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any

from deepinfer.engine.outputs import PromptLogprobs
from deepinfer.hashing import hash_blocks, root_hash
from deepinfer.protocol import FinishReason


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    #: Holding blocks while their KV is loaded from the host tier or the kvcache store (vLLM's
    #: WAITING_FOR_REMOTE_KVS): never scheduled; Scheduler.finish_loading moves it to RUNNING (loaded) or back to
    #: WAITING, or PREEMPTED for a resume (recomputed).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def needs_prompt_logits(self) -> bool:
        """True while its prompt logprobs are owed: every prompt position is computed here, none reused from a
        cache (cached KV has no logits; vLLM skips the prefix cache for these requests too)."""
        return self.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        """True for the three terminal statuses."""
        # Module globals, not RequestStatus.X: an enum class attribute lookup costs ~0.1 us, and the scheduler
        # asks this of every request every step.
        return self is _FINISHED_STOPPED or self is _FINISHED_LENGTH or self is _FINISHED_ABORTED


_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
_FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH
_FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


class Request:
    """One sequence: prompt and output token ids, KV progress, and the hashes of its full blocks.

    sampling_params is duck-typed: any object with max_tokens (None = up to max_model_len), min_tokens,
    ignore_eos and stop_token_ids. Token ids of all_token_ids are prompt then output; the output includes the
    token that stopped the request (eos or a stop token), as vLLM does.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        cache_salt: str = "",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        #: Prompt tokens found in the prefix cache at first admission (not updated after a preemption).
        self.num_cached_tokens = 0
        #: Of num_cached_tokens, those loaded from the kvcache store (the rest were in the device pool).
        self.num_store_cached_tokens = 0
        #: Of num_cached_tokens, those loaded from the host-memory tier.
        self.num_host_cached_tokens = 0
        self.num_preemptions = 0
        #: time.monotonic() when the scheduler first gave it a step (None while it waits): queue vs compute time.
        self.first_scheduled_time: float | None = None
        #: Keep the KV blocks referenced after finishing (a prefill worker's lease); Scheduler.release_held ends it.
        self.hold_blocks = False
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        #: The stop token id that ended the request (None for eos, length or abort).
        self.stop_reason: int | None = None
        #: Prompt then output token ids (the live list: read it, never mutate it). One list appended in place, so
        #: slicing the next tokens each step costs O(new tokens), not O(context); an attribute, not a property:
        #: the scheduler reads it for every request every step.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self._block_size: int | None = None
        self._hash_root: bytes = b""
        self._block_hashes: list[bytes] = []
        self._stop_rule: _StopRule | None = None
        #: Speculative decoding: tokens the drafter proposed after the last step, fed with the next one (the
        #: scheduler takes them; the same empty tuple while there are none: no list per request per step).
        self.draft_token_ids: Sequence[int] = ()
        #: Structured output: the request's GrammarMatcher (deepinfer.structured), advanced by every output token.
        self.grammar: Any = None
        #: Asked prompt_logprobs: gathered by the runner as the prompt's chunks are computed, handed out (and set
        #: back to None) by the scheduler's update with the first sampled token. None: not asked, or handed out.
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """True while its prompt logprobs are owed: every prompt position is computed here, none reused from a
        cache (cached KV has no logits; vLLM skips the prefix cache for these requests too)."""
        return self.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        """True once the request has a terminal status."""
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append sampled tokens (their KV is computed by the next step)."""
        token_ids = list(token_ids)
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.grammar is not None:
            self.grammar.accept_all(token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token (the decode step's case, without building a sequence)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    @property
    def stop_rule(self) -> _StopRule:
        """The sampling params' stop conditions, read once (sampling params do not change while running)."""
        if self._stop_rule is None:
            self._stop_rule = _StopRule.of(self.sampling_params, self.eos_token_ids)
        return self._stop_rule

    def bind_block_hashing(self, block_size: int, model_fingerprint: bytes) -> None:
        """Fix how block_hashes are computed; the scheduler calls it on add_request."""
        root = root_hash(model_fingerprint, self.cache_salt)
        if self._block_size is not None and (self._block_size, self._hash_root) != (block_size, root):
            raise ValueError(
                f"request {self.request_id}: block hashing already bound to another configuration"
            )
        self._block_size, self._hash_root = block_size, root

    @property
    def block_hashes(self) -> list[bytes]:
        """Hashes of the full blocks of all_token_ids, extended incrementally as tokens are appended."""
        block_size = self._block_size
        if block_size is None:
            raise RuntimeError(
                f"request {self.request_id}: block hashing not bound (Scheduler.add_request does it)"
            )
        num_hashed = len(self._block_hashes)
        num_full_blocks = self.num_tokens // block_size
        if num_full_blocks > num_hashed:
            parent = self._block_hashes[-1] if num_hashed else self._hash_root
            new_tokens = self.all_token_ids[num_hashed * block_size : num_full_blocks * block_size]
            self._block_hashes.extend(hash_blocks(new_tokens, block_size, b"", "", start_parent=parent))
        return self._block_hashes

    def adopt_block_hashes(self, block_hashes: Sequence[bytes]) -> None:
        """Start `block_hashes` from the hashes of its leading full blocks that another Request computed for the same
        tokens under the same hashing (a draft model's mirror of the round before: engine/draft_model.py), so they
        are not hashed again. Only before any hash of its own, once bound (Scheduler.add_request)."""
        assert self._block_size is not None and not self._block_hashes, self.request_id
        assert len(block_hashes) * self._block_size <= self.num_tokens, self.request_id
        self._block_hashes = list(block_hashes)

    def finish(self, status: RequestStatus, reason: FinishReason, stop_reason: int | None = None) -> None:
        """Move to a terminal status."""
        assert status.is_finished, status
        self.status, self.finish_reason, self.stop_reason = status, reason, stop_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


class _StopRule:
    """A request's stop conditions as plain attributes: eos / stop ids (after min_tokens), max_tokens."""

    __slots__ = ("eos_ids", "max_tokens", "min_tokens", "stop_ids")

    def __init__(self, max_tokens: int | None, min_tokens: int, eos_ids: frozenset[int], stop_ids: frozenset[int]):
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.eos_ids = eos_ids  # empty under ignore_eos
        self.stop_ids = stop_ids  # eos_ids | stop_token_ids

    @classmethod
    def of(cls, params: Any, eos_token_ids: set[int]) -> _StopRule:
        """Read the duck-typed sampling params once."""
        eos = frozenset() if getattr(params, "ignore_eos", False) else frozenset(eos_token_ids)
        stop_ids = eos | frozenset(getattr(params, "stop_token_ids", None) or ())
        return cls(getattr(params, "max_tokens", None), getattr(params, "min_tokens", 0) or 0, eos, stop_ids)


def hand_out_prompt_logprobs(request: Request) -> PromptLogprobs:
    """The prompt logprobs a request gathered, taken from it (it owes none from now on); called with its first
    sampled token, when every prompt position has been scored."""
    prompt_logprobs = request.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == request.num_prompt_tokens - 1, (
        request.request_id, None if prompt_logprobs is None else len(prompt_logprobs), request.num_prompt_tokens)
    request.prompt_logprobs = None
    return prompt_logprobs


def append_sampled_token(request: Request, token_id: int, max_model_len: int) -> bool:
    """Append one sampled token and finish the request if it ends it; True when it did (the decode step's case:
    `append_output_token_id` then `check_stop`, inline, with check_stop only when the token may end it)."""
    output_token_ids, all_token_ids = request.output_token_ids, request.all_token_ids
    output_token_ids.append(token_id)
    all_token_ids.append(token_id)
    grammar = request.grammar
    if grammar is not None:
        grammar.accept(token_id)
    rule = request._stop_rule or request.stop_rule
    max_tokens = rule.max_tokens
    if (
        token_id in rule.stop_ids
        or grammar is not None
        or (max_tokens is not None and len(output_token_ids) >= max_tokens)
        or len(all_token_ids) >= max_model_len
    ):
        return check_stop(request, max_model_len)
    return False


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish the request if its last token ends it; True when it did.

    Order: eos (unless ignore_eos), stop_token_ids — both only once min_tokens are out — then a grammar that
    allows nothing more ("stop"), then max_tokens and max_model_len ("length"). An eos id also listed in
    stop_token_ids reports no stop_reason, as before.
    """
    rule = request._stop_rule or request.stop_rule  # the attribute first: this runs for every token
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    last_token_id = output_token_ids[-1]
    if last_token_id in rule.stop_ids and num_output_tokens >= rule.min_tokens:
        if last_token_id in rule.eos_ids:
            request.finish(RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
        else:
            request.finish(RequestStatus.FINISHED_STOPPED, FinishReason.STOP, stop_reason=last_token_id)
        return True
    if request.grammar is not None and request.grammar.is_stopped:  # complete (or broken: the gateway checks)
        request.finish(RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
        return True
    max_tokens = rule.max_tokens
    if (max_tokens is not None and num_output_tokens >= max_tokens) or len(request.all_token_ids) >= max_model_len:
        request.finish(RequestStatus.FINISHED_LENGTH, FinishReason.LENGTH)
        return True
    return False
