"""The gateway as a `deepinfer.service.Handler`: heartbeats + token subject + the API server, with a drain.

    gateway = GatewayHandler(settings, bus, registry, model)   # the one wiring path (main.build, the tests)
    await gateway.subscribe()     # heartbeats → membership, this gateway's token subject
    await gateway.start()         # subscribe, then serve the API on settings.host:port
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, MessageBus, Subscriptions
from deepinfer.config import GatewaySettings
from deepinfer.membership import Membership
from deepinfer.protocol import WorkerLoad
from deepinfer.telemetry import InternalServer, serve_internal
from deepinfer.telemetry.hops import Hops
from services.gateway.app import ApiState, create_app
from services.gateway.errors import overloaded
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import RequestPipeline
from services.gateway.recipe import ModelInfo
from services.gateway.streams import TokenStreams

#: What is left of the drain grace for background publishes (Cancel) once in-flight requests are done.
MIN_TASK_DRAIN_S = 1.0
#: Past the grace: how long the requests ended with an error get to write it (error event + [DONE], or a 503).
ABORT_WRITE_S = 2.0


class GatewayHandler:
    """One gateway process: start → serve (API on host:port) → drain (refuse new, finish in flight) → close."""

    def __init__(
        self,
        settings: GatewaySettings,
        bus: MessageBus,
        registry: CollectorRegistry,
        model: ModelInfo,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.port = settings.port
        self.membership = Membership(settings.worker_lease_s)
        self.streams = TokenStreams(bus, model.served_model_name, settings.gateway_id)
        hops = Hops(tracer, registry, "gateway")
        metrics = GatewayMetrics(registry)
        self.pipeline = RequestPipeline(
            bus, settings, model.served_model_name, self.membership, self.streams, hops,
            on_reissue=lambda kind: metrics.reissues.labels(kind).inc(),
            on_fallback_route=lambda reason: metrics.fallback_routes.labels(reason).inc(),
        )
        self.state = ApiState(self.pipeline, model, metrics, settings, hops)
        self.app = create_app(self.state)
        self.server: InternalServer | None = None
        self._subscriptions = Subscriptions(bus)

    async def subscribe(self) -> None:
        """Follow heartbeats into the membership table and open this gateway's token subject."""
        name = self.state.model.served_model_name
        await self._subscriptions.subscribe(
            "heartbeats", subjects.heartbeat_all(name), self._on_heartbeat, message_type=WorkerLoad
        )
        await self.streams.start()

    async def start(self) -> None:
        """Subscribe, then listen for HTTP."""
        await self.subscribe()
        self.server = await serve_internal(
            self.app, self.settings.host, self.settings.port, reuse_port=self.settings.reuse_port
        )
        self.port = self.server.port

    async def _on_heartbeat(self, load: WorkerLoad, msg: IncomingMsg) -> None:
        self.membership.observe(load)

    def is_ready(self) -> bool:
        """Model loaded (always, once built) and a decode-capable worker alive (it computes prompts itself when no
        prefill worker is there)."""
        return self.not_ready_reason() == ""

    def not_ready_reason(self) -> str:
        """Why not ready ("" when ready)."""
        return self.state.not_ready_reason()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503), wait for in-flight ones up to `grace_s`; past it end every one still running
        with an error (an error event + [DONE] on a stream, a 503 otherwise: its Cancel goes to the workers); stop
        the API server, then flush the background publishes (Cancel) so they leave before the bus closes."""
        self.state.accepting = False
        deadline_s = time.monotonic() + grace_s
        await self._wait_in_flight(deadline_s)
        if self.state.metrics.num_in_flight > 0:
            error = overloaded(f"the server is shutting down: the request did not finish within the drain grace "
                               f"({grace_s:g} s)", self.settings.retry_after_s)
            self.pipeline.abort_all(error)
            deadline_s = time.monotonic() + ABORT_WRITE_S
            await self._wait_in_flight(deadline_s)
        if self.server is not None:
            await self.server.stop(timeout_s=max(0.1, deadline_s - time.monotonic()))
            self.server = None
        await self.pipeline.tasks.drain(max(MIN_TASK_DRAIN_S, deadline_s - time.monotonic()))

    async def _wait_in_flight(self, deadline_s: float) -> None:
        while self.state.metrics.num_in_flight > 0 and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop everything; idempotent."""
        if self.server is not None:
            await self.server.stop(timeout_s=1.0)
            self.server = None
        await self._subscriptions.close()
        await self.streams.stop()
        await self.pipeline.tasks.drain(MIN_TASK_DRAIN_S)
