"""Drive a decode worker as the gateway does, for integration tests: send a DecodeRequest without a KV handle (the
worker computes the prompt itself) and collect the request's token stream until it finishes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deepinfer import subjects
from deepinfer.bus import MessageBus
from deepinfer.protocol import (
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    TokenBatch,
    TokenChunk,
    WireSamplingParams,
)


async def decode_locally(bus: MessageBus, model: str, decode_id: str, gateway_id: str, request_id: str,
                         prompt: Sequence[int], sampling: WireSamplingParams,
                         timeout_s: float = 30) -> tuple[list[int], TokenChunk]:
    """Decode worker `decode_id` computes `prompt`: (every token it streamed, the first chunk)."""
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_batch(batch: TokenBatch, msg) -> None:
        for chunk in batch.chunks:
            if chunk.request_id == request_id:
                chunks.append(chunk)
                if chunk.finish_reason is not None:
                    done.set()

    sub = await bus.subscribe(subjects.tokens(model, gateway_id), on_batch, message_type=TokenBatch)
    try:
        accepted = await bus.request(subjects.decode(model, decode_id), DecodeRequest(
            request_id=request_id, gateway_id=gateway_id, prompt_token_ids=list(prompt), sampling=sampling),
            DecodeAccepted, timeout_s=timeout_s)
        assert accepted.status is DecodeStatus.ACCEPTED, accepted
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return [t for c in chunks for t in c.token_ids], chunks[0]
