"""Grammars over one tokenizer: compile-checking (gateway) and per-request matchers (workers), via llguidance.

    grammars = Grammars(tokenizer)              # ~0.3 s for a 50k vocabulary: build once per process
    grammars.check(grammar)                     # GrammarError naming what llguidance refused (one short line)
    matcher = grammars.matcher(grammar)         # one per request
    matcher.fill_bitmask(words)                 # the allowed next tokens, one bit each (int32 words)
    matcher.accept(token_id)                    # after each sampled token; is_stopped: nothing may follow
    matcher.num_allowed(draft_token_ids)        # speculative decoding: the draft's prefix the grammar allows
    matcher.bitmasks_along(draft_token_ids)     # the masks of a verify step's rows, the matcher left unmoved

A grammar is llguidance's JSON grammar text (what `LLMatcher.grammar_from_*` return); it travels as a string in
the request's sampling params, so prefill and decode build the same matcher and the decode worker continues it
from the first token the prefill worker sampled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from deepinfer.tokenizer import Tokenizer

#: Resource bounds of one grammar (llguidance's defaults are far larger): compile work, lexer states, size.
#: initial_lexer_fuel bounds a hostile schema's compile (a 1000×1000-character pattern: refused in ~0.1 s here,
#: ~1 s at llguidance's 1M) and also the bounded numbers one schema may hold (numbers.py: ~5k fuel each, so
#: about 100 in one schema; past that a 400 says the grammar exceeds this server's limits).
LIMITS = dict(
    initial_lexer_fuel=200_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=50_000,
)


#: Tokens of one path the gateway walks through a new grammar before admitting it (Grammars.check): a lexeme or
#: parser state past the limits usually shows at the first token (`"` of a 100,000-character pattern, `{"` of an
#: object that nests without end), so a request fails here with a 400 instead of after it started.
PROBE_TOKENS = 4
#: How the probe's refusals begin (the schema compiled; its grammar cannot be run).
NOTHING_ALLOWED = "no output satisfies the grammar"
OVER_LIMITS = "the grammar exceeds this server's limits"
PROBE_MESSAGES = (NOTHING_ALLOWED, OVER_LIMITS)
#: Longest error message passed on (llguidance's own can run to kilobytes of parser state).
MAX_ERROR_CHARS = 200
#: Compiled grammars kept per process (matchers are deep copies of these: ~20 µs instead of a compile, up to
#: ~100 ms for a large schema with bounded numbers); least recently used dropped first.
MAX_COMPILED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar llguidance refuses (an unsupported feature, a bad reference, a limit); the message is one short
    line, never the parser's state."""


def public_error(message: str) -> str:
    """llguidance's error as one short line: its first line, without the `<state>` dump that may follow."""
    line = message.split("<state>", 1)[0].strip().splitlines()
    text = line[0].strip() if line else "invalid grammar"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def parser_limits() -> llguidance.LLParserLimits:
    """The parser limits every matcher and check uses."""
    return llguidance.LLParserLimits(**LIMITS)


class Grammars:
    """Compiles grammars against one tokenizer (llguidance's view of it is built on first use, then kept)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        #: Pristine matchers by grammar text, least recently used first (requests reuse a few schemas).
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

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
        """GrammarError when llguidance would refuse `grammar` (compile errors and limits; warnings pass), when no
        output satisfies it, or when its first PROBE_TOKENS tokens along one path hit the parser's limits."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=parser_limits()
        )
        if is_error:
            raise GrammarError(public_error(messages[0] if messages else "invalid grammar"))
        self._probe(self.matcher(grammar))

    def _probe(self, matcher: GrammarMatcher) -> None:
        """Walk the lowest allowed non-EOS token PROBE_TOKENS times (each mask ~0.3 ms): GrammarError when the
        start allows nothing, or a step errs (a lexer or parser limit)."""
        eos_bits = sum(1 << t for t in self.tokenizer.eos_token_ids if t < self.vocab_size)
        for step in range(PROBE_TOKENS):
            allowed = int.from_bytes(matcher.bitmask(), "little") & ~eos_bits
            if step == 0 and not allowed and not matcher.is_accepting:
                raise GrammarError(NOTHING_ALLOWED)
            if matcher.error:
                raise GrammarError(f"{OVER_LIMITS}: {matcher.error}")
            if not allowed:
                return  # complete: nothing but EOS may follow
            if not matcher.accept((allowed & -allowed).bit_length() - 1):
                raise GrammarError(f"{OVER_LIMITS}: {matcher.error}")

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one); GrammarError if it does not
        compile."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
            if compiled.is_error():
                raise GrammarError(public_error(compiled.get_error()))
            with self._lock:
                self._compiled[grammar] = compiled
                while len(self._compiled) > MAX_COMPILED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy(), self.vocab_size)


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

    def num_allowed(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows in order (where a draft is cut before it is
        verified); the matcher does not move."""
        return self._matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def bitmasks_along(self, token_ids: list[int]) -> list[bytes]:
        """The bitmask before each of `token_ids` and after the last (len + 1 masks: the rows of a step verifying
        them as a draft), the matcher back where it was. Every token must be allowed (`num_allowed`)."""
        masks = [self.bitmask()]
        num_consumed = 0
        for token_id in token_ids:
            if self._matcher.is_stopped():
                # Only EOS may follow, and llguidance keeps an EOS taken here off its rollback stack. The request
                # ends at the token that stopped the grammar, so these rows are never kept: its mask will do.
                masks.append(masks[-1])
                continue
            if not self._matcher.consume_token(token_id):
                raise ValueError(f"bitmasks_along: token {token_id} is not allowed ({self.error})")
            num_consumed += 1
            masks.append(self.bitmask())
        if num_consumed and not self._matcher.rollback(num_consumed):
            raise RuntimeError(f"bitmasks_along: rollback of {num_consumed} tokens failed ({self.error})")
        return masks

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
        """Why the matcher is in error, in one short line ("" when it is not)."""
        message = self._matcher.get_error()
        return public_error(message) if message else ""
