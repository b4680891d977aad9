"""The decode worker's fast TokenBatch encoding gives exactly the bytes of the pydantic models, and decodes
back through `TokenBatch.from_bytes` as the gateway reads it."""

from __future__ import annotations

import pytest

from deepinfer.protocol import (
    FinishReason,
    TokenBatch,
    TokenChunk,
    TokenLogprobs,
    encode_token_batch,
    token_chunk_fields,
)

CASES = [
    {"request_id": "r0", "token_ids": [7]},
    {"request_id": "r1", "token_ids": [1, 2, 3], "num_cached_tokens": 32,
     "cached_tokens_by_tier": {"device": 16, "store": 16}, "num_previous_tokens": 5},
    {"request_id": "r2", "token_ids": [], "finish_reason": FinishReason.ABORT},
    {"request_id": "r3", "token_ids": [9], "finish_reason": FinishReason.STOP, "num_cached_tokens": 0},
    {"request_id": "r4", "token_ids": [4, 5], "finish_reason": FinishReason.LENGTH,
     "logprobs": [TokenLogprobs(token_id=4, logprob=-0.5, top=[(4, -0.5), (8, -1.25)]),
                  TokenLogprobs(token_id=5, logprob=-2.0)]},
]


@pytest.mark.parametrize("chunks", [CASES[:1], CASES, []])
def test_fast_encoding_equals_the_models(chunks):
    fields = [token_chunk_fields(c["request_id"], c["token_ids"], logprobs=c.get("logprobs"),
                                 finish_reason=c.get("finish_reason"), num_cached_tokens=c.get("num_cached_tokens"),
                                 cached_tokens_by_tier=c.get("cached_tokens_by_tier"),
                                 num_previous_tokens=c.get("num_previous_tokens"))
              for c in chunks]
    models = TokenBatch(worker_id="decode-1", step=41, chunks=[TokenChunk(**c) for c in chunks])
    payload = encode_token_batch("decode-1", 41, fields)
    assert payload == models.to_bytes()
    assert TokenBatch.from_bytes(payload) == models


def test_every_chunk_field_is_written():
    # A field added to TokenChunk must be added to token_chunk_fields too (or the fast path drops it).
    assert set(token_chunk_fields("r", [1])) == set(TokenChunk.model_fields)
