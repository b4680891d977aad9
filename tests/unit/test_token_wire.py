"""`TokenBatchWriter` (the decode worker's per-step TokenBatch bytes, joined from cached fragments) gives exactly
the bytes of the pydantic models for every kind of chunk, and they decode back as the gateway reads them."""

from __future__ import annotations

import msgpack
import pytest

from deepinfer.protocol import (
    ErrorCode,
    ErrorDetail,
    FinishReason,
    PromptLogprobs,
    TokenBatch,
    TokenBatchWriter,
    TokenChunk,
    TokenLogprobs,
    chunk_prefix,
    token_wire,
)
from deepinfer.protocol.token_wire import PACKED_COUNTS, num_chunks

STEADY = [
    {"request_id": "r0", "token_ids": [7], "num_previous_tokens": 0},
    {"request_id": "chatcmpl-" + "x" * 40, "token_ids": [128_000], "num_previous_tokens": 70_000},
    {"request_id": "é-ü", "token_ids": [1, 2, 3, 300, 70_000], "num_previous_tokens": 255},
    {"request_id": "r3", "token_ids": [], "num_previous_tokens": 65_536},
]
OTHER = [
    {"request_id": "first", "token_ids": [1, 2, 3], "num_cached_tokens": 32,
     "cached_tokens_by_tier": {"device": 16, "store": 16}, "num_previous_tokens": 5},
    {"request_id": "first-no-tier", "token_ids": [4], "num_cached_tokens": 0, "num_previous_tokens": 0},
    {"request_id": "abort", "token_ids": [], "finish_reason": FinishReason.ABORT},
    {"request_id": "stop", "token_ids": [9], "finish_reason": FinishReason.STOP, "num_cached_tokens": 0,
     "num_previous_tokens": 12},
    {"request_id": "logprobs", "token_ids": [4, 5], "finish_reason": FinishReason.LENGTH, "num_previous_tokens": 2,
     "logprobs": [TokenLogprobs(token_id=4, logprob=-0.5, top=[(4, -0.5), (8, -1.25)]),
                  TokenLogprobs(token_id=5, logprob=-2.0)]},
    {"request_id": "error", "token_ids": [], "finish_reason": FinishReason.ERROR,
     "error": ErrorDetail(code=ErrorCode.OVERLOADED, message="draining")},
    {"request_id": "prompt-logprobs", "token_ids": [6], "num_cached_tokens": 0, "num_previous_tokens": 0,
     "prompt_logprobs": PromptLogprobs(logprobs=[-3.25, -0.5], ranks=[40, 1], top_token_ids=[[2], [9]],
                                       top_logprobs=[[-0.75], [-0.5]])},
]


def _write(writer: TokenBatchWriter, step: int, steady: list[dict], other: list[dict]) -> bytes:
    pieces = writer.open()
    for chunk in steady:
        writer.add_steady(pieces, chunk_prefix(chunk["request_id"]), chunk["token_ids"], chunk["num_previous_tokens"])
    for chunk in other:
        fields = {k: v for k, v in chunk.items() if k not in ("request_id", "token_ids")}
        writer.add(pieces, chunk_prefix(chunk["request_id"]), chunk["token_ids"], **fields)
    assert num_chunks(pieces) == len(steady) + len(other)
    return writer.close(pieces, step)


@pytest.mark.parametrize(("steady", "other"), [
    (STEADY[:1], []), (STEADY, []), ([], OTHER), (STEADY, OTHER), ([], []), (STEADY[:1], OTHER[4:5]),
])
def test_writer_gives_the_models_bytes(steady, other):
    writer = TokenBatchWriter("decode-1")
    payload = _write(writer, 41, steady, other)
    models = TokenBatch(worker_id="decode-1", step=41, chunks=[TokenChunk(**c) for c in steady + other])
    assert payload == models.to_bytes()
    assert TokenBatch.from_bytes(payload) == models


@pytest.mark.parametrize("num_chunks", [15, 16, 64, 256, 65_536])
def test_array_header_at_every_size(num_chunks):
    # fixarray up to 15 chunks, array16 above, array32 from 65,536: a c=256 step is an array16.
    chunks = [{"request_id": f"r{i}", "token_ids": [i % 50_000], "num_previous_tokens": i} for i in range(num_chunks)]
    payload = _write(TokenBatchWriter("w"), 2**40, chunks, [])
    models = TokenBatch(worker_id="w", step=2**40, chunks=[TokenChunk(**c) for c in chunks])
    assert payload == models.to_bytes()


def test_a_writer_is_reused_across_steps():
    writer = TokenBatchWriter("decode-1")
    first = _write(writer, 1, STEADY, OTHER[:1])
    second = _write(writer, 2, STEADY[1:], [])
    assert TokenBatch.from_bytes(first).step == 1
    assert second == TokenBatch(worker_id="decode-1", step=2, chunks=[TokenChunk(**c) for c in STEADY[1:]]).to_bytes()


def test_every_chunk_field_is_written():
    # A field added to TokenChunk must be written by `add` (and be nil in a steady chunk), or this fails.
    pieces = TokenBatchWriter("w").open()
    TokenBatchWriter("w").add(pieces, chunk_prefix("r"), [1])
    chunk = msgpack.unpackb(b"".join(pieces[1:]))
    assert list(chunk) == list(TokenChunk.model_fields)


def test_cached_fragments_are_the_packed_bytes():
    # One-token arrays come from the writer's cache after their first use, counts below PACKED_COUNTS from a table
    # packed once: the same bytes as packing them, on both sides of every msgpack int width and the table's end.
    writer = TokenBatchWriter("decode-1")
    counts = [0, 127, 128, 255, 256, 65_535, PACKED_COUNTS - 1, PACKED_COUNTS, 2**32]
    token_ids = [0, 127, 128, 65_535, 65_536, 200_000, -1]
    for _ in range(2):  # the second pass reads every one-token array from the cache
        chunks = [{"request_id": f"r{i}", "token_ids": [token_ids[i % len(token_ids)]], "num_previous_tokens": count}
                  for i, count in enumerate(counts)]
        payload = _write(writer, 3, chunks, [])
        assert payload == TokenBatch(worker_id="decode-1", step=3, chunks=[TokenChunk(**c) for c in chunks]).to_bytes()
    assert set(writer.one_token) == set(token_ids)
    assert all(writer.one_token[t] == msgpack.packb([t]) for t in token_ids)
    assert writer.token_ids([1, 2]) == msgpack.packb([1, 2]) and writer.token_ids([]) == msgpack.packb([])


def test_the_one_token_cache_stops_growing_at_its_bound(monkeypatch):
    monkeypatch.setattr(token_wire, "MAX_ONE_TOKEN_ARRAYS", 4)
    writer = TokenBatchWriter("decode-1")
    assert [writer.token_ids([t]) for t in range(10)] == [msgpack.packb([t]) for t in range(10)]
    assert len(writer.one_token) == 4


def test_last_chunks_reuse_their_middle_and_stay_the_models_bytes():
    writer = TokenBatchWriter("decode-1")
    chunks = [{"request_id": "s", "token_ids": [9], "finish_reason": FinishReason.STOP, "num_previous_tokens": 3},
              {"request_id": "l", "token_ids": [], "finish_reason": FinishReason.LENGTH, "num_previous_tokens": 0},
              {"request_id": "e", "token_ids": [], "finish_reason": FinishReason.STOP, "num_cached_tokens": 4},
              {"request_id": "x", "token_ids": [1], "finish_reason": FinishReason.STOP, "num_previous_tokens": 300}]
    for step in (1, 2):  # the second step's last chunks take the middles kept by the first
        models = TokenBatch(worker_id="decode-1", step=step, chunks=[TokenChunk(**c) for c in chunks])
        assert _write(writer, step, [], chunks) == models.to_bytes()
