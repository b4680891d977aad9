"""Chat prompts encoded piecewise: the text between added tokens is encoded once and then looked up.

    encoder = SegmentEncoder.for_tokenizer(tokenizer)   # None when the tokenizer's added tokens do not split cleanly
    token_ids = encoder.encode(text)                    # == tokenizer.encode(text, add_special_tokens=False)

A rendered chat is mostly the same text every time: the system prompt, the role headers, the newlines between
turns, all separated by the template's added tokens (`<|im_start|>`, `<|eot_id|>`, ...). Hugging Face's tokenizers
split a text at its added tokens first and then normalize, pre-tokenize and run the model on each piece on its
own, so the ids of the whole are the ids of the pieces joined. Where that holds (no normalizer; added tokens
without lstrip / rstrip / single_word, all matched in one pass; checked once on probe texts as well) the pieces'
ids are cached and only the new ones (usually the last user message) go through the tokenizer. On the default
model a 43-token chat with a new user message takes ~29 µs instead of ~60, most of it the new message.
"""

from __future__ import annotations

import re

from deepinfer.tokenizer import Tokenizer
from deepinfer.tokenizer.tokenizer import encode_ids

#: Pieces kept (a piece is the text between two added tokens); when full the cache starts over (no LRU
#: bookkeeping per lookup: the pieces that repeat are back after one request each).
MAX_PIECES = 2048
#: Longer pieces are encoded every time (a long message is rarely sent twice; the cache stays small).
MAX_PIECE_CHARS = 2048
#: Texts the split is checked on once: added tokens next to spaces, digits, newlines and each other.
_PROBES = (" {0}  hello {1}\n\n{0}{1} 12 x{0}\n", "{1}system\nYou are 3 bots.{0}\n{1}user\n Hi!{0}{1}", "a{0}b")


class SegmentEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)` with the pieces between added tokens cached."""

    def __init__(self, tokenizer: Tokenizer, added: dict[str, int]) -> None:
        self.backend = tokenizer.backend
        self.added = added
        longest_first = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(content) for content in longest_first) + ")").split
        self._pieces: dict[str, list[int]] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> SegmentEncoder | None:
        """An encoder when splitting at the added tokens gives the tokenizer's own ids, else None."""
        backend = tokenizer.backend
        tokens = backend.get_added_tokens_decoder()
        if backend.normalizer is not None or not tokens:
            return None
        if any(t.lstrip or t.rstrip or t.single_word or not t.content for t in tokens.values()):
            return None
        if len({t.normalized for t in tokens.values()}) > 1:  # matched in two passes: one regex could differ
            return None
        encoder = cls(tokenizer, {t.content: token_id for token_id, t in tokens.items()})
        contents = sorted(encoder.added)
        pairs = [(contents[0], contents[-1]), (contents[-1], contents[len(contents) // 2])]
        for probe in _PROBES:
            for first, second in pairs:
                text = probe.format(first, second)
                if encoder.encode(text, cache=False) != backend.encode(text, add_special_tokens=False).ids:
                    return None
        return encoder

    def encode(self, text: str, cache: bool = True) -> list[int]:
        """Token ids of `text` (no post-processor: no BOS added)."""
        token_ids: list[int] = []
        added, pieces, backend = self.added, self._pieces, self.backend
        for i, piece in enumerate(self._split(text)):
            if i % 2:  # re.split with one group: odd items are the separators, the added tokens
                token_ids.append(added[piece])
                continue
            if not piece:
                continue
            ids = pieces.get(piece)
            if ids is None:
                ids = encode_ids(backend, piece)  # a long piece with the GIL released
                if cache and len(piece) <= MAX_PIECE_CHARS:
                    if len(pieces) >= MAX_PIECES:
                        pieces.clear()
                    pieces[piece] = ids
            token_ids += ids
        return token_ids
