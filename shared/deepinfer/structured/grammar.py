"""Grammars over one tokenizer: compile-checking (gateway) and per-request matchers (workers), via llguidance.

    grammars = Grammars(tokenizer)              # ~0.3 s for a 50k vocabulary: build once per process
    grammars.check(grammar)                     # GrammarError naming what llguidance refused
    matcher = grammars.matcher(grammar)         # one per request
    matcher.fill_bitmask(words)                 # the allowed next tokens, one bit each (int32 words)
    matcher.accept(token_id)                    # after each sampled token; is_stopped: nothing may follow

A grammar is llguidance's JSON grammar text (what `LLMatcher.grammar_from_*` return); it travels as a string in
the request's sampling params, so prefill and decode build the same matcher and the decode worker continues it
from the first token the prefill worker sampled.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from deepinfer.tokenizer import Tokenizer

#: Resource bounds of one grammar (llguidance's defaults are far larger): compile work, lexer states, size.
LIMITS = dict(
    initial_lexer_fuel=200_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=50_000,
)


class GrammarError(ValueError):
    """A grammar llguidance refuses (an unsupported feature, a bad reference, a limit)."""


def parser_limits() -> llguidance.LLParserLimits:
    """The parser limits every matcher and check uses."""
    return llguidance.LLParserLimits(**LIMITS)


class Grammars:
    """Compiles grammars against one tokenizer (llguidance's view of it is built on first use, then kept)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer (tokenizer.json's vocabulary; EOS = the model's end tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                eos = sorted(self.tokenizer.eos_token_ids)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), eos_token=eos or None
                )
            return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        """Tokens the masks cover (ids at or past it are never allowed under a grammar)."""
        return self.ll_tokenizer.vocab_size

    def check(self, grammar: str) -> None:
        """GrammarError when llguidance would refuse `grammar` (compile errors and limits; warnings pass)."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=parser_limits()
        )
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it does not compile."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar: the mask of allowed next tokens, advanced by each accepted token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        #: int32 words of the bitmask: vocab_size bits rounded up.
        self.num_words = (vocab_size + 31) // 32

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the matcher is then in error)."""
        return self._matcher.consume_token(token_id)

    def accept_all(self, token_ids: list[int]) -> bool:
        """Advance by several tokens (a resumed request's output so far)."""
        return not token_ids or self._matcher.consume_tokens(list(token_ids))

    def bitmask(self) -> bytes:
        """The allowed next tokens: bit i of little-endian int32 word i // 32 set when token i is allowed."""
        return self._matcher.compute_bitmask()

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete), or the matcher is in error."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher is in error ("" when it is not)."""
        return self._matcher.get_error()
