"""Stand-in scheduler + decode worker for bench/gateway/gateway_burst.py, one process of its own on a real nats-server.

    PYTHONPATH=shared:. python bench/gateway/gateway_burst_workers.py NATS_URL TOKEN MODEL STEP_MS TOKEN_IDS   # prints "ready" once subscribed

They are stand-ins, not the real services, on purpose: the bench measures the gateway's CPU, and on this 2-core
machine the tiny model's engine (and the scheduler's and decode worker's own loops) would compete with the
gateway for the same cores and drown the number. What the gateway sees is what the real ones send, built by the
same code: the scheduler's RouteDecision reply on its queue group, the decode worker's DecodeAccepted reply, then
one TokenBatch per step and gateway with a chunk for every running request (`token_chunk_fields` +
`encode_token_batch`, as services/decode/handler.py does), heartbeats (`worker_load`) so the gateway hashes blocks
and is ready. A request finishes with `length` at its max_tokens; a Cancel drops it.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from deepinfer import subjects
from deepinfer.bus import Bus, IncomingMsg, Subscriptions
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    FinishReason,
    RouteDecision,
    RouteRequest,
    RouteStatus,
    WorkerRole,
    encode_token_batch,
    token_chunk_fields,
)
from deepinfer.testing.fake_workers import worker_load

DECODE_ID = "decode-0"
FINGERPRINT = b"\x01" * 32
HEARTBEAT_S = 0.5


@dataclass
class Running:
    """One admitted request: where its tokens go, how many it wants and has had."""

    gateway_id: str
    max_tokens: int
    num_tokens: int = 0


class StandInWorkers:
    """The route and decode responders and the decode step loop."""

    def __init__(self, bus: Bus, model: str, step_s: float, token_ids: list[int]) -> None:
        self.bus, self.model, self.step_s, self.token_ids = bus, model, step_s, token_ids
        self.running: dict[str, Running] = {}
        self.step = 0

    async def start(self) -> None:
        """Subscribe (route on the scheduler's queue group, this worker's decode subject, cancels)."""
        subs = Subscriptions(self.bus)
        model = self.model
        await subs.subscribe("route", subjects.route(model), self._route, queue=subjects.SCHEDULER_QUEUE,
                             message_type=RouteRequest)
        await subs.subscribe("decode", subjects.decode(model, DECODE_ID), self._decode, message_type=DecodeRequest)
        await subs.subscribe("cancel", subjects.cancel(model), self._cancel, message_type=Cancel)
        await self.bus.flush()

    async def _route(self, request: RouteRequest, msg: IncomingMsg) -> None:
        await self.bus.reply(msg, RouteDecision(request_id=request.request_id, status=RouteStatus.ACCEPTED,
                                                decode_worker_id=DECODE_ID, scheduler_id="scheduler-0"))

    async def _decode(self, request: DecodeRequest, msg: IncomingMsg) -> None:
        self.running[request.request_id] = Running(request.gateway_id, request.sampling.max_tokens or 16)
        await self.bus.reply(msg, DecodeAccepted(request_id=request.request_id, status=DecodeStatus.ACCEPTED))

    async def _cancel(self, cancel: Cancel, msg: IncomingMsg) -> None:
        self.running.pop(cancel.request_id, None)

    async def heartbeats(self) -> None:
        """A decode worker's WorkerLoad every HEARTBEAT_S."""
        while True:
            load = worker_load(DECODE_ID, WorkerRole.DECODE, self.model, model_fingerprint=FINGERPRINT,
                               max_num_seqs=1024, max_model_len=8192, num_running=len(self.running))
            await self.bus.publish(subjects.heartbeat(self.model, DECODE_ID), load)
            await asyncio.sleep(HEARTBEAT_S)

    async def steps(self) -> None:
        """Every step_s: one token for every running request, one TokenBatch per gateway."""
        while True:
            await asyncio.sleep(self.step_s)
            if self.running:
                await self._publish_step()

    async def _publish_step(self) -> None:
        batches: dict[str, list[dict]] = {}
        for request_id, run in list(self.running.items()):
            token_id = self.token_ids[run.num_tokens % len(self.token_ids)]
            done = run.num_tokens + 1 >= run.max_tokens
            chunk = token_chunk_fields(
                request_id, [token_id], finish_reason=FinishReason.LENGTH if done else None,
                num_cached_tokens=0 if run.num_tokens == 0 else None, num_previous_tokens=run.num_tokens,
            )
            run.num_tokens += 1
            batches.setdefault(run.gateway_id, []).append(chunk)
            if done:
                del self.running[request_id]
        for gateway_id, chunks in batches.items():
            await self.bus.publish(subjects.tokens(self.model, gateway_id), encode_token_batch(DECODE_ID, self.step,
                                                                                               chunks))
        self.step += 1


async def main(url: str, token: str, model: str, step_ms: float, token_ids: list[int]) -> None:
    """Serve until killed."""
    bus = await Bus.connect(url, name="stand-in-workers", token=token)
    workers = StandInWorkers(bus, model, step_ms / 1000, token_ids)
    await workers.start()
    print("ready", flush=True)
    await asyncio.gather(workers.heartbeats(), workers.steps())


if __name__ == "__main__":
    url_arg, token_arg, model_arg, step_arg, ids_arg = sys.argv[1:6]
    asyncio.run(main(url_arg, token_arg, model_arg, float(step_arg), [int(t) for t in ids_arg.split(",")]))
