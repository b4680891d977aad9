"""Turning one choice's token chunks into text deltas: incremental detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.protocol import TokenChunk, TokenLogprobs, WireSamplingParams
from deepinfer.structured import GrammarMatcher
from deepinfer.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from services.gateway.errors import worker_lost
from services.gateway.openai_models import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


@dataclass
class ChoiceDelta:
    """What one choice gained from one chunk: text safe to send, its tokens' logprobs, and the end if reached."""

    index: int
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    #: True when a stop string (seen here, not by the worker) ended the choice: the workers must be cancelled.
    stopped_by_string: bool = False


class ChoiceOutput:
    """The output state of one choice; `add` each chunk in order."""

    def __init__(
        self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], sampling: WireSamplingParams,
        checker: GrammarMatcher | None = None,
    ):
        self.index = index
        #: Structured output: the request's grammar, fed every token (a worker that ignored it is caught here).
        self.checker = checker
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, sampling.skip_special_tokens)
        self.stop_checker = StopChecker(sampling.stop, sampling.include_stop_str_in_output)
        self._text_parts: list[str] = []  # joined when read: `text +=` per chunk copied the whole text each time
        self.logprobs: list[TokenLogprobs] = []
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None
        self.cached_tokens_by_tier: dict[str, int] | None = None
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """The choice's text so far (every delta's text, in order)."""
        return _joined(self._text_parts)

    def add(self, chunk: TokenChunk) -> ChoiceDelta:
        """Feed one chunk; the returned delta's text never ends in half a character or half a stop string."""
        if self.finish_reason is not None:
            return ChoiceDelta(self.index, "", finish_reason=self.finish_reason)
        if chunk.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = chunk.num_cached_tokens
            self.cached_tokens_by_tier = chunk.cached_tokens_by_tier
        self.num_output_tokens += len(chunk.token_ids)
        if self.checker is not None:
            self._check_grammar(chunk)
        new_logprobs = list(chunk.logprobs or [])
        self.logprobs.extend(new_logprobs)
        text = self.detokenizer.step(chunk.token_ids)
        if chunk.finish_reason is not None:
            text += self.detokenizer.flush()
        emitted, stopped = self.stop_checker.step(text)
        delta = ChoiceDelta(self.index, emitted, new_logprobs)
        if stopped:
            delta.finish_reason, delta.stopped_by_string = "stop", True
        elif chunk.finish_reason is not None:
            delta.text += self.stop_checker.flush()
            delta.finish_reason = chunk.finish_reason.value
        if delta.text:
            self._text_parts.append(delta.text)
        self.finish_reason = delta.finish_reason
        return delta

    def _check_grammar(self, chunk: TokenChunk) -> None:
        """502 when a token breaks the grammar, or the output ends by a stop before the grammar is complete."""
        checker = self.checker
        assert checker is not None
        for token_id in chunk.token_ids:
            if not checker.accept(token_id):
                raise worker_lost(f"the output broke the requested format at token {token_id}: {checker.error}")
        if chunk.finish_reason == "stop" and not checker.is_accepting:
            raise worker_lost("the output stopped before completing the requested format")


def _joined(parts: list[str]) -> str:
    """`parts` as one string, kept as the list's only part so the next read costs nothing."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
    """OpenAI chat shape: `content[{token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}]`."""
    content = []
    for entry in logprobs:
        token = _token_text(tokenizer, entry.token_id)
        top = [
            TopLogprob(token=(text := _token_text(tokenizer, token_id)), logprob=lp, bytes=list(text.encode()))
            for token_id, lp in entry.top
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: list[TokenLogprobs], text_offset_start: int, with_top: bool
) -> tuple[CompletionLogprobs, int]:
    """OpenAI completions shape (parallel lists) and the text offset after the last token."""
    result = CompletionLogprobs(top_logprobs=[] if with_top else None)
    offset = text_offset_start
    for entry in logprobs:
        token = _token_text(tokenizer, entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.text_offset.append(offset)
        offset += len(token)
        if result.top_logprobs is not None:
            result.top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in entry.top})
    return result, offset
