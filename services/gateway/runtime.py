"""The gateway as a `deepinfer.service.Handler`: heartbeats + token subject + the API server, with a drain."""

from __future__ import annotations

import asyncio
import logging
import time

from deepinfer import subjects
from deepinfer.bus import MessageBus, Subscription
from deepinfer.protocol import WorkerLoad
from deepinfer.telemetry import InternalServer, serve_internal
from services.gateway.app import ApiState, create_app
from services.gateway.handler import GatewayHandler, GatewayTimeouts
from services.gateway.metrics import GatewayMetrics
from services.gateway.recipe import ModelInfo
from services.gateway.streams import TokenStreams
from services.gateway.workers import WorkerTable

logger = logging.getLogger(__name__)


class Gateway:
    """One gateway process: start → serve (API on host:port) → drain (refuse new, finish in flight) → close."""

    def __init__(
        self,
        bus: MessageBus,
        model: ModelInfo,
        gateway_id: str,
        metrics: GatewayMetrics,
        host: str,
        port: int,
        api_keys: list[str],
        max_request_bytes: int,
        timeouts: GatewayTimeouts | None = None,
        worker_lease_s: float = 3.0,
    ) -> None:
        self.bus = bus
        self.host, self.port = host, port
        self.workers = WorkerTable(lease_s=worker_lease_s)
        self.streams = TokenStreams(bus, model.served_model_name, gateway_id)
        self.handler = GatewayHandler(bus, model.served_model_name, gateway_id, self.workers, self.streams, timeouts)
        self.state = ApiState(self.handler, model, metrics, api_keys, max_request_bytes)
        self.app = create_app(self.state)
        self.server: InternalServer | None = None
        self._heartbeats: Subscription | None = None

    async def start(self) -> None:
        """Follow heartbeats, open the token subject, then listen for HTTP."""
        name = self.state.model.served_model_name
        self._heartbeats = await self.bus.subscribe(
            subjects.heartbeat_all(name), self.workers.on_heartbeat, message_type=WorkerLoad
        )
        await self.streams.start()
        self.server = await serve_internal(self.app, self.host, self.port)
        self.port = self.server.port

    def is_ready(self) -> bool:
        """Model loaded (always, once built), a prefill-capable and a decode-capable worker alive."""
        return self.not_ready_reason() == ""

    def not_ready_reason(self) -> str:
        """Why not ready ("" when ready)."""
        if not self.state.accepting:
            return "draining"
        if not self.workers.has_prefill():
            return "no prefill-capable worker seen in heartbeats"
        if not self.workers.has_decode():
            return "no decode-capable worker seen in heartbeats"
        return ""

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503), wait for in-flight ones up to `grace_s`, then stop the API server."""
        self.state.accepting = False
        deadline_s = time.monotonic() + grace_s
        while self.state.metrics.num_in_flight > 0 and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)
        if self.server is not None:
            await self.server.stop(timeout_s=max(0.1, deadline_s - time.monotonic()))
            self.server = None

    async def close(self) -> None:
        """Stop everything; idempotent."""
        if self.server is not None:
            await self.server.stop(timeout_s=1.0)
            self.server = None
        if self._heartbeats is not None:
            await self._heartbeats.unsubscribe()
            self._heartbeats = None
        await self.streams.stop()
        await self.handler.drain()
