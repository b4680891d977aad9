"""Streaming detokenization: text for new tokens as soon as it is complete, never half a character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.tokenizer.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text deltas whose concatenation equals `tokenizer.decode(output_ids)`.

    Two offsets into the output ids (vLLM's scheme):

        output_token_ids: [ ... emitted ... | prefix_offset ... read_offset | new ids ... ]
                                              `-- decoded again as context; its text was already emitted

    A delta is emitted only when the window's text does not end in U+FFFD, so a UTF-8 character split
    over several byte-level tokens is held back until its last byte arrives. Each window starts on a
    token whose text began cleanly, so its decode is a prefix-consistent extension of what was sent.
    The text is relative to the output alone (prompt_token_ids are kept for callers, not as context), so
    streamed and non-streamed results are the same string.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        #: The text emitted so far, in pieces (`output_text` joins them): a `str +=` per step copied it all.
        self._text_parts: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def output_text(self) -> str:
        """All the text emitted so far."""
        parts = self._text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def step(self, new_token_ids: list[int]) -> str:
        """Append new output ids; return the text they completed ("" while a character is incomplete)."""
        return self.take_windows(*self._decode(*self.next_windows(new_token_ids)))

    def next_windows(self, new_token_ids: list[int]) -> tuple[list[int], list[int]]:
        """`step`'s first half: append the ids; the two id windows it decodes (prefix, window). Callers that
        detokenize many sequences at once decode every sequence's windows in one `Tokenizer.decode_batch`."""
        ids = self.output_token_ids
        ids.extend(new_token_ids)
        return ids[self._prefix_offset : self._read_offset], ids[self._prefix_offset :]

    def take_windows(self, prefix_text: str, window_text: str) -> str:
        """`step`'s second half, given the windows of `next_windows` decoded: the text completed."""
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(window_text[len(prefix_text) :])

    def step_each(self, new_token_ids: list[int]) -> str:
        """`step([t])` for each of `new_token_ids` in turn, the deltas joined (same text, same end state), with the
        windows decoded in one `Tokenizer.decode_batch` call: it speculates that every step completes its text
        (the common case: windows of the last two tokens); a window the speculation missed is decoded alone.
        The offline LLM detokenizes a sequence without stop strings this way once it has finished."""
        ids = self.output_token_ids
        first = len(ids)
        ids.extend(new_token_ids)
        end = len(ids)
        if end == first:
            return ""
        prefix_offset, read_offset = self._prefix_offset, self._read_offset
        keys = {(prefix_offset, read_offset): None, (prefix_offset, first + 1): None}
        for n in range(first + 2, end + 1):
            keys[(max(n - 2, 0), n - 1)] = None
            keys[(max(n - 2, 0), n)] = None
        skip = self.skip_special_tokens
        texts = dict(zip(keys, self.tokenizer.decode_batch([ids[a:b] for a, b in keys], skip_special_tokens=skip),
                         strict=True))
        decode, parts = self.tokenizer.decode, []
        for n in range(first + 1, end + 1):
            prefix_text = texts.get((prefix_offset, read_offset))
            if prefix_text is None:
                prefix_text = decode(ids[prefix_offset:read_offset], skip_special_tokens=skip)
            window_text = texts.get((prefix_offset, n))
            if window_text is None:
                window_text = decode(ids[prefix_offset:n], skip_special_tokens=skip)
            if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
                continue
            parts.append(window_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, n
        self._prefix_offset, self._read_offset = prefix_offset, read_offset
        self._text_parts.extend(parts)
        return "".join(parts)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete sequence decodes as U+FFFD)."""
        prefix_text, window_text = self._decode(*self.next_windows([]))
        if len(window_text) <= len(prefix_text):
            return ""
        return self._advance(window_text[len(prefix_text) :])

    def _decode(self, prefix_ids: list[int], window_ids: list[int]) -> tuple[str, str]:
        """The texts of `next_windows`' two id windows."""
        skip = self.skip_special_tokens
        return (self.tokenizer.decode(prefix_ids, skip_special_tokens=skip),
                self.tokenizer.decode(window_ids, skip_special_tokens=skip))

    def _advance(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.output_token_ids)
        self._text_parts.append(delta)
        return delta
