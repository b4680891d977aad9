"""The internal HTTP app every service mounts: /health, /ready, /metrics (never behind the API key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deepinfer.telemetry.metrics import render

log = logging.getLogger(__name__)


def internal_app(
    registry: CollectorRegistry,
    is_ready: Callable[[], bool],
    service_name: str,
    not_ready_reason: Callable[[], str] | None = None,
    unhealthy_reason: Callable[[], str] | None = None,
) -> Starlette:
    """/health: 200 while the process can serve or recover (503 with the reason `unhealthy_reason` gives, e.g. a
    failed or stuck engine: restart me); /ready: 200 or 503 with a reason; /metrics: `registry` as text."""

    async def health(_: Request) -> Response:
        reason = unhealthy_reason() if unhealthy_reason is not None else ""
        if reason:
            return JSONResponse({"status": "unhealthy", "service": service_name, "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "service": service_name})

    async def ready(_: Request) -> Response:
        try:
            ok = bool(is_ready())
            reason = "" if ok else (not_ready_reason() if not_ready_reason else f"{service_name} is not ready")
        except Exception as exc:  # a failing probe means "not ready", never a 500
            ok, reason = False, f"readiness check failed: {exc}"
        if ok:
            return JSONResponse({"status": "ready", "service": service_name})
        return JSONResponse({"status": "not ready", "service": service_name, "reason": reason}, status_code=503)

    async def metrics(_: Request) -> Response:
        body, content_type = render(registry)
        return Response(body, media_type=content_type)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)


class _Server(uvicorn.Server):
    # The service owns SIGTERM/SIGINT (drain, then exit); uvicorn must not take them over.
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass
class InternalServer:
    """A running internal HTTP server; `port` is the bound one (useful with port 0)."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and wait for the server task (forcing open connections closed after `timeout_s`)."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except TimeoutError:
            self.server.force_exit = True
            await self.task


async def serve_internal(app: Starlette, host: str, port: int, reuse_port: bool = False) -> InternalServer:
    """Serve `app` on host:port (0 = any free port) in a task; returns once it accepts connections.

    `reuse_port`: SO_REUSEPORT, so several processes listen on one port and the kernel spreads the connections.
    """
    # Bind here so that a port in use raises OSError in the caller instead of uvicorn calling sys.exit.
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"internal-http-{bound_port}")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # re-raises the startup error
            raise RuntimeError(f"internal HTTP server on {host}:{bound_port} stopped during startup")
        await asyncio.sleep(0.01)
    log.info("internal HTTP server listening", extra={"host": host, "port": bound_port})
    return InternalServer(server=server, task=task, host=host, port=bound_port)
