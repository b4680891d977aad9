"""TokenBatch wire bytes from cached msgpack fragments, for the decode worker's per-step path.

A msgpack map is its header then each key and value packed one after the other, so a TokenChunk's bytes can be
joined from pieces. What a request's chunks share is packed once, when its stream opens (`chunk_prefix`: the
map header, `v`, the request id, the `token_ids` key); a steady chunk (no logprobs, not the first, not the
last) is then four pieces, two of them packed per step:

    prefix | token_ids | nil logprobs ... nil error, "num_previous_tokens" key | num_previous_tokens

(every chunk is these four pieces, `add` joins the middle of any other), and one gateway's batch is one
`b"".join` of its chunks' pieces behind the batch header. Most steady pieces are not even packed: a one-token
array is packed once per token id and kept (`one_token`), counts below PACKED_COUNTS once per process
(`counts`), a last chunk's middle once per finish reason: a pack call costs more than the few bytes it writes
(argument parsing, a new bytes object). The bytes are those of `TokenBatch(...).to_bytes()` (field order,
types, the `v` of every model): `tests/unit/test_token_wire.py` checks them against the models for every kind of
chunk. The gateway decodes them with `TokenBatch.from_bytes`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import msgpack

from deepinfer.protocol.base import Message
from deepinfer.protocol.errors import ErrorDetail
from deepinfer.protocol.tokens import FinishReason, PromptLogprobs, TokenBatch, TokenChunk, TokenLogprobs

_pack = msgpack.Packer().pack  # stateless between calls (autoreset); C code, never releases the GIL mid-call
_VERSION = Message.model_fields["v"].default
#: `v` and its value: the first field of every model.
_V = _pack("v") + _pack(_VERSION)
_CHUNK_FIELDS = tuple(TokenChunk.model_fields)
_BATCH_FIELDS = tuple(TokenBatch.model_fields)
_CHUNK_HEADER = (0x80 | len(_CHUNK_FIELDS)).to_bytes(1, "big")  # a fixmap: at most 15 fields
_BATCH_HEADER = (0x80 | len(_BATCH_FIELDS)).to_bytes(1, "big")
_KEY = {name: _pack(name) for name in _CHUNK_FIELDS + _BATCH_FIELDS}
#: After the token ids of a steady chunk: every optional field nil, then the key of num_previous_tokens.
STEADY_MIDDLE = b"".join(_KEY[name] + _pack(None) for name in _CHUNK_FIELDS[3:-1]) + _KEY["num_previous_tokens"]
_NIL = _pack(None)
#: num_previous_tokens below this are packed once per process (`TokenBatchWriter.counts`).
PACKED_COUNTS = 1 << 16
#: One-token arrays a writer keeps packed (`TokenBatchWriter.one_token`): every token id of a usual vocabulary,
#: ~100 bytes each (so at most ~26 MB).
MAX_ONE_TOKEN_ARRAYS = 1 << 18


def chunk_prefix(request_id: str) -> bytes:
    """The bytes every TokenChunk of `request_id` starts with, up to its token ids: pack once per request."""
    return _CHUNK_HEADER + _V + _KEY["request_id"] + _pack(request_id) + _KEY["token_ids"]


class TokenBatchWriter:
    """One decode worker's TokenBatches as bytes. A batch is a list of pieces: `open()` it, add its chunks
    (`add_steady`, or `add` for any chunk), then `close()` it into the batch's bytes. Not thread-safe (one
    packer, `pack`); the worker uses it on its event loop only."""

    def __init__(self, worker_id: str) -> None:
        #: msgpack of one value (what add_steady packs: the token ids, num_previous_tokens).
        self.pack = msgpack.Packer().pack
        #: msgpack of `[token_id]` by token id, kept as tokens come (`token_ids`).
        self.one_token: dict[int, bytes] = {}
        #: msgpack of every count below PACKED_COUNTS, by count.
        self.counts = _packed_counts()
        #: The middle of a chunk with only a finish reason (a last chunk), by finish reason (None: steady).
        self._finish_middles: dict[FinishReason | None, bytes] = {}
        self._head = _BATCH_HEADER + _V + _KEY["worker_id"] + _pack(worker_id) + _KEY["step"]

    @staticmethod
    def open() -> list[bytes]:
        """A new batch: its first piece is a place for the header, written by `close`."""
        return [b""]

    def add_steady(self, pieces: list[bytes], prefix: bytes, token_ids: Sequence[int],
                   num_previous_tokens: int) -> None:
        """A chunk with only new tokens: no logprobs, finish reason, cached tokens or error."""
        count = self.counts[num_previous_tokens] if num_previous_tokens < PACKED_COUNTS else self.pack(
            num_previous_tokens)
        pieces += (prefix, self.token_ids(token_ids), STEADY_MIDDLE, count)

    def token_ids(self, token_ids: Sequence[int]) -> bytes:
        """msgpack of `token_ids`; a one-token array is packed once per token id (then `one_token[token_id]`)."""
        if len(token_ids) != 1:
            return self.pack(token_ids)
        token_id = token_ids[0]
        packed = self.one_token.get(token_id)
        if packed is None:
            packed = self.pack(token_ids)
            if len(self.one_token) < MAX_ONE_TOKEN_ARRAYS and type(token_id) is int:
                self.one_token[token_id] = packed
        return packed

    def add(
        self,
        pieces: list[bytes],
        prefix: bytes,
        token_ids: Sequence[int],
        *,
        logprobs: Sequence[TokenLogprobs] | None = None,
        finish_reason: FinishReason | None = None,
        num_cached_tokens: int | None = None,
        cached_tokens_by_tier: Mapping[str, int] | None = None,
        error: ErrorDetail | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
        num_previous_tokens: int | None = None,
    ) -> None:
        """Any chunk (the first one, with logprobs, the last one, an error)."""
        pack = self.pack
        plain = (logprobs is None and num_cached_tokens is None and cached_tokens_by_tier is None and error is None
                 and prompt_logprobs is None)
        middle = self._finish_middles.get(finish_reason) if plain else None  # a last chunk: one per finish reason
        if middle is None:
            middle = b"".join((
                _KEY["logprobs"], _NIL if logprobs is None else pack([lp.model_dump(mode="python") for lp in logprobs]),
                _KEY["finish_reason"], pack(finish_reason),
                _KEY["num_cached_tokens"], pack(num_cached_tokens),
                _KEY["cached_tokens_by_tier"], pack(cached_tokens_by_tier),
                _KEY["error"], _NIL if error is None else pack(error.model_dump(mode="python")),
                _KEY["prompt_logprobs"],
                _NIL if prompt_logprobs is None else pack(prompt_logprobs.model_dump(mode="python")),
                _KEY["num_previous_tokens"],
            ))
            if plain:
                self._finish_middles[finish_reason] = middle
        pieces += (prefix, pack(token_ids), middle, pack(num_previous_tokens))

    def close(self, pieces: list[bytes], step: int) -> bytes:
        """The batch's bytes: `TokenBatch(worker_id, step, chunks).to_bytes()`."""
        pieces[0] = self._head + self.pack(step) + _KEY["chunks"] + _array_header(num_chunks(pieces))
        return b"".join(pieces)


@functools.cache
def _packed_counts() -> tuple[bytes, ...]:
    return tuple(_pack(count) for count in range(PACKED_COUNTS))


def num_chunks(pieces: list[bytes]) -> int:
    """The chunks in a batch's pieces (four each, behind the header's place)."""
    return (len(pieces) - 1) // 4


def _array_header(length: int) -> bytes:
    if length < 16:
        return (0x90 | length).to_bytes(1, "big")
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")
