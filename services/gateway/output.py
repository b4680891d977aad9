"""Turning one choice's token chunks into text deltas: incremental detokenization, stop strings, logprobs (of the
generated tokens, and of the prompt's when asked), and the logprobs' response shapes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from deepinfer.protocol import PromptLogprobs, TokenChunk, TokenLogprobs, WireSamplingParams
from deepinfer.structured import GrammarMatcher
from deepinfer.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from services.gateway.errors import worker_lost
from services.gateway.openai_models import (
    MIN_LOGPROB,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprobList,
    PromptTokenLogprob,
    TopLogprob,
)


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
    """The output state of one choice; `add` each chunk in order.

    `scores_only` (completions' echo with max_tokens 0): the workers generate one token, as they cannot generate
    none, and it is dropped here; the choice is its prompt alone, finished by length."""

    def __init__(
        self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], sampling: WireSamplingParams,
        checker: GrammarMatcher | None = None, *, scores_only: bool = False,
    ):
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.scores_only = scores_only
        #: The prompt's logprobs, from the worker that computed the prompt (the request asked for them).
        self.prompt_logprobs: PromptLogprobs | None = None
        self._wants_prompt_logprobs = sampling.prompt_logprobs is not None
        self._num_chunks = 0
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
        self._num_chunks += 1
        if self._wants_prompt_logprobs and self.prompt_logprobs is None:
            self._take_prompt_logprobs(chunk)
        if self.scores_only:
            return self._scored_prompt(chunk)
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

    def _take_prompt_logprobs(self, chunk: TokenChunk) -> None:
        """The first chunk carries the prompt's logprobs (a migrated request's later attempts ask for none); 502
        when it does not (a worker of protocol < 2.7 ignored the field), never a silent null."""
        scores = chunk.prompt_logprobs
        if scores is None:
            if self._num_chunks == 1:
                raise worker_lost("the worker computed the prompt but sent no prompt logprobs (protocol < 2.7?)")
            return
        if len(scores.logprobs) != len(self.prompt_token_ids) - 1:
            raise worker_lost(f"prompt logprobs for {len(scores.logprobs) + 1} tokens, the prompt has "
                              f"{len(self.prompt_token_ids)}")
        self.prompt_logprobs = scores

    def _scored_prompt(self, chunk: TokenChunk) -> ChoiceDelta:
        """scores_only: the generated token is not the client's; the choice ends (length) with the first chunk."""
        if chunk.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = chunk.num_cached_tokens
            self.cached_tokens_by_tier = chunk.cached_tokens_by_tier
        self.finish_reason = "length"
        return ChoiceDelta(self.index, "", finish_reason="length", stopped_by_string=chunk.finish_reason is None)

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


class _TokenTexts(dict[int, str]):
    """Each token id's text, decoded once per response (a prompt's scores name the same tokens again and again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = _token_text(self.tokenizer, token_id)
        return text


#: One position of the completions logprobs: its token, its logprob (None: a prompt's first token, which has no
#: context) and the most likely tokens there, best first.
LogprobEntry = tuple[int, float | None, Sequence[tuple[int, float]]]


def sampled_entries(logprobs: Iterable[TokenLogprobs]) -> Iterator[LogprobEntry]:
    """The entries of generated tokens."""
    for entry in logprobs:
        yield entry.token_id, entry.logprob, entry.top


def prompt_entries(prompt_token_ids: Sequence[int], scores: PromptLogprobs) -> Iterator[LogprobEntry]:
    """The entries of a prompt's tokens: the first has none, each other its logprob and its position's top k."""
    yield prompt_token_ids[0], None, ()
    for token_id, logprob, top_ids, top_logprobs in zip(
        prompt_token_ids[1:], scores.logprobs, scores.top_token_ids, scores.top_logprobs, strict=True
    ):
        yield token_id, logprob, list(zip(top_ids, top_logprobs, strict=True))


def _floor(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # -inf (a banned token) has no JSON form


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
    tokenizer: Tokenizer, entries: Iterable[LogprobEntry], text_offset_start: int, num_top: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completions shape (parallel lists) and the text offset after the last token. A position's
    top_logprobs holds its own token, then the `num_top` most likely (up to num_top + 1 entries, as OpenAI and
    vLLM: the position's token first; a text two of them share keeps the larger logprob, so the largest value is
    always the position's most likely token's, which lm-eval's greedy check reads); a prompt's first token has
    null for both."""
    texts = _TokenTexts(tokenizer)
    result = CompletionLogprobs(top_logprobs=[])
    tokens, token_logprobs, text_offset, top_logprobs = (result.tokens, result.token_logprobs, result.text_offset,
                                                         result.top_logprobs)
    offset = text_offset_start
    for token_id, logprob, top in entries:
        token = texts[token_id]
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_floor(logprob))
        position = {token: _floor(logprob)}
        seen = {token_id}
        for top_id, top_logprob in top:
            if len(seen) > num_top:
                break
            if top_id not in seen:
                seen.add(top_id)
                # tokens whose texts are alike (parts of one character) share a key: it keeps the most likely
                text, value = texts[top_id], _floor(top_logprob)
                if value > position.get(text, MIN_LOGPROB - 1):
                    position[text] = value
        top_logprobs.append(position)
    return result, offset


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                         scores: PromptLogprobs) -> PromptLogprobList:
    """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}} with the
    prompt token first and the position's top k after it (ranks 1..k)."""
    texts = _TokenTexts(tokenizer)
    result: PromptLogprobList = [None]
    for token_id, logprob, rank, top_ids, top_logprobs in zip(
        prompt_token_ids[1:], scores.logprobs, scores.ranks, scores.top_token_ids, scores.top_logprobs, strict=True
    ):
        position = {token_id: PromptTokenLogprob(logprob=_floor(logprob), rank=rank, decoded_token=texts[token_id])}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
            if top_id not in position:
                position[top_id] = PromptTokenLogprob(logprob=_floor(top_logprob), rank=top_rank,
                                                      decoded_token=texts[top_id])
        result.append(position)
    return result
