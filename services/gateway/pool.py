"""Several gateway processes behind one API port (settings.processes > 1): a small parent that runs them.

One Python process turns a few thousand tokens a second into SSE (docs/serving-path.md); the parent starts N
children (`python -m services.gateway` with processes=1, reuse_port=true, gateway_id `<id>-<i>` and a private
internal port each), and the kernel spreads the API port's connections over them (SO_REUSEPORT). The parent:

- restarts a child that exits or hangs (deepinfer.up's Supervisor: exponential backoff, logged; SIGTERM to the
  children if the parent dies), and exits 1 when a child crashes START_CRASHES times before it was ever ready
  (or exits with a configuration error): restarting the container is then the only help;
- serves the configured internal port for them all: /health (200 while every child is alive), /ready (200 once
  every child's /ready is 200, else 503 with the first reason), /metrics (every child's exposition, each sample
  labelled `gateway_process="<i>"`, and `deepinfer_gateway_process_restarts_total`);
- on SIGTERM/SIGINT turns /ready off and stops the children (they drain within their own grace; SIGKILL past
  it); a second signal is forwarded, cutting their drain short.

It never imports the API app: its memory and start-up stay small.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deepinfer.config import CommonSettings, GatewaySettings, env_name
from deepinfer.cpus import CORES_PER_GATEWAY, usable_cpus
from deepinfer.nats_server import free_port
from deepinfer.service import DRAIN_OVERRUN_S, EXIT_FAILED, EXIT_OK
from deepinfer.telemetry import serve_internal, setup_logging
from deepinfer.telemetry.exposition import merge_expositions
from deepinfer.up.probes import HttpReadyProbe
from deepinfer.up.supervisor import START_CRASHES, ChildSpec, RestartPolicy, Supervisor, SupervisorError

log = logging.getLogger(__name__)

SERVICE = "gateway"
#: The label telling the children's series apart in the parent's /metrics.
PROCESS_LABEL = "gateway_process"
#: Children's internal ports listen on loopback only: the parent is their one client.
CHILD_INTERNAL_HOST = "127.0.0.1"
#: After a child's drain grace and overrun: its bus drain and exit.
EXIT_MARGIN_S = 3.0
#: How often the parent checks that children start (and how long one probe of a child may take).
WATCH_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 1.0
#: A gateway process starts in a second or two and each one down costs 1/N of the port: restart it sooner than
#: `deepinfer up` restarts a worker.
RESTART_POLICY = RestartPolicy(initial_delay_s=0.25, max_delay_s=5.0)


@dataclass(frozen=True)
class PoolChild:
    """One gateway process: its index (the metrics label), supervisor name and private internal port."""

    index: int
    name: str
    internal_port: int

    @property
    def internal_url(self) -> str:
        """Base URL of its /health, /ready and /metrics."""
        return f"http://{CHILD_INTERNAL_HOST}:{self.internal_port}"


def child_env(settings: GatewaySettings, child: PoolChild, base: dict[str, str]) -> dict[str, str]:
    """The parent's environment with one process's settings on top (settings travel only through the env)."""
    fields = {
        "processes": "1",
        "reuse_port": "true",
        "gateway_id": child.name,
        "host": settings.host,
        "port": str(settings.port),
        "internal_port": str(child.internal_port),
    }
    env = {**base, **{env_name(GatewaySettings, key): value for key, value in fields.items()}}
    env[env_name(CommonSettings, "internal_host")] = CHILD_INTERNAL_HOST
    env["PYTHONUNBUFFERED"] = "1"
    return env


class GatewayPool:
    """The parent of `num_processes` gateway processes; `run()` until SIGTERM/SIGINT or `stop()`."""

    def __init__(self, settings: GatewaySettings, num_processes: int) -> None:
        self.settings = settings
        self.children = [
            PoolChild(i, f"{settings.gateway_id}-{i}", free_port(CHILD_INTERNAL_HOST)) for i in range(num_processes)
        ]
        grace_s = settings.drain_grace_s + DRAIN_OVERRUN_S + EXIT_MARGIN_S
        self.supervisor = Supervisor(None, RESTART_POLICY, grace_s=grace_s)
        self.internal_port: int | None = None
        self._started: set[str] = set()
        self._stop = asyncio.Event()
        self._stopping = False
        self._http: httpx.AsyncClient | None = None

    def child_specs(self) -> list[ChildSpec]:
        """How each child runs: this interpreter, the image's module entry, its env; /health as liveness."""
        argv = (sys.executable, "-m", "services.gateway")
        base = dict(os.environ)
        return [
            ChildSpec(child.name, argv, child_env(self.settings, child, base),
                      liveness=HttpReadyProbe(f"{child.internal_url}/health"))
            for child in self.children
        ]

    def stop(self) -> None:
        """Begin a graceful stop (as SIGTERM); a second call forwards SIGTERM again (children cut their drain)."""
        if self._stop.is_set():
            self._signal_children(signal.SIGTERM)
        self._stop.set()

    async def run(self) -> int:
        """Start the children and the internal server, wait for a stop or a child that will not start; 0 = clean."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as self._http:
            try:
                return await self._serve()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    async def _serve(self) -> int:
        internal = await serve_internal(self.app(), self.settings.common.internal_host, self.settings.internal_port)
        self.internal_port = internal.port
        code = EXIT_OK
        try:
            for spec in self.child_specs():
                self.supervisor.add(spec)
            await asyncio.to_thread(self.supervisor.start)
            log.info("gateway pool started: %d processes%s on port %d, internal_port=%d",
                     len(self.children), self._why_count(), self.settings.port, internal.port,
                     extra={"service": SERVICE, "processes": len(self.children), "ports": {"internal": internal.port}})
            watch = asyncio.create_task(self._watch_start())
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait({watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            watch.cancel()
            stop.cancel()
            if watch in done and not watch.cancelled() and watch.exception() is not None:
                log.error("gateway pool failed: %s", watch.exception())
                code = EXIT_FAILED
        except SupervisorError as exc:
            log.error("gateway pool failed: %s", exc)
            code = EXIT_FAILED
        finally:
            self._stopping = True
            await asyncio.to_thread(self.supervisor.stop)
            await internal.stop()
        log.info("gateway pool stopped", extra={"service": SERVICE})
        return code

    def _why_count(self) -> str:
        if self.settings.processes is not None:
            return ""
        return f" (processes unset: one per {CORES_PER_GATEWAY} of {usable_cpus()} usable cores)"

    async def _watch_start(self) -> None:
        """Record each child's first /ready 200; raise SupervisorError for one that will not start (its /health
        answers while it builds, before it binds the API port: only /ready says it started). Runs until cancelled:
        returning would read as a failure in `_serve`."""
        while True:
            for child in self.children:
                if child.name in self._started:
                    continue
                if await self._get(child, "/ready") is not None:
                    self._started.add(child.name)
                    continue
                crashes = sum(event.name == child.name for event in self.supervisor.events)
                if self.supervisor.gave_up(child.name) or crashes >= START_CRASHES:
                    why = "a configuration error" if self.supervisor.gave_up(child.name) else f"{crashes} crashes"
                    raise SupervisorError(f"{child.name} never started ({why}); see its log lines above")
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _on_signal(self, sig: signal.Signals) -> None:
        again = self._stop.is_set()
        log.info("gateway pool: %s received%s", sig.name, ", forwarding it" if again else ", stopping the processes")
        self.stop()

    def _signal_children(self, sig: int) -> None:
        for child in self.children:
            with contextlib.suppress(SupervisorError):
                self.supervisor.kill(child.name, sig)

    async def _get(self, child: PoolChild, path: str) -> httpx.Response | None:
        """GET a child's internal path: its response when 200, else None (down, starting, not ready)."""
        assert self._http is not None
        try:
            response = await self._http.get(child.internal_url + path)
        except httpx.HTTPError:
            return None
        return response if response.status_code == 200 else None

    # -- the internal port ---------------------------------------------------------------------------------------
    def unhealthy_reason(self) -> str:
        """Why /health is 503: a child that is not running ("" while every child is)."""
        down = [child.name for child in self.children if self.supervisor.pid(child.name) is None]
        return f"gateway process {', '.join(down)} not running (restarting)" if down else ""

    async def not_ready_reason(self) -> str:
        """Why /ready is 503 ("" once every child answers /ready 200)."""
        if self._stopping or self._stop.is_set():
            return "stopping: draining in-flight work"
        answers = await asyncio.gather(*(self._ready_reason(child) for child in self.children))
        return next((reason for reason in answers if reason), "")

    async def _ready_reason(self, child: PoolChild) -> str:
        assert self._http is not None
        try:
            response = await self._http.get(child.internal_url + "/ready")
        except httpx.HTTPError as exc:
            return f"{child.name}: not answering ({type(exc).__name__})"
        if response.status_code == 200:
            return ""
        try:
            reason = response.json().get("reason") or f"HTTP {response.status_code}"
        except ValueError:
            reason = f"HTTP {response.status_code}"
        return f"{child.name}: {reason}"

    async def metrics_text(self) -> str:
        """Every answering child's exposition, merged under the `gateway_process` label, and the restarts."""
        responses = await asyncio.gather(*(self._get(child, "/metrics") for child in self.children))
        texts = {str(child.index): r.text for child, r in zip(self.children, responses, strict=True) if r is not None}
        return merge_expositions(texts, PROCESS_LABEL) + self.restarts_text()

    def restarts_text(self) -> str:
        """`deepinfer_gateway_process_restarts_total{gateway_process}`: restarts after an exit or a hang."""
        name = "deepinfer_gateway_process_restarts_total"
        lines = [f"# HELP {name} Restarts of each gateway process by its parent (after an exit or a hang).",
                 f"# TYPE {name} counter"]
        lines += [f'{name}{{{PROCESS_LABEL}="{child.index}"}} {self.supervisor.restart_count(child.name)}.0'
                  for child in self.children]
        return "\n".join(lines) + "\n"

    def app(self) -> Starlette:
        """The parent's /health, /ready and /metrics (the shapes of deepinfer.telemetry's internal app)."""

        async def health(_: Request) -> Response:
            reason = self.unhealthy_reason()
            if reason:
                return JSONResponse({"status": "unhealthy", "service": SERVICE, "reason": reason}, status_code=503)
            return JSONResponse({"status": "ok", "service": SERVICE})

        async def ready(_: Request) -> Response:
            reason = await self.not_ready_reason()
            if reason:
                return JSONResponse({"status": "not ready", "service": SERVICE, "reason": reason}, status_code=503)
            return JSONResponse({"status": "ready", "service": SERVICE})

        async def metrics(_: Request) -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(await self.metrics_text(), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route(path, fn, methods=["GET"]) for path, fn in
                                 (("/health", health), ("/ready", ready), ("/metrics", metrics))])


def run_pool(settings: GatewaySettings, num_processes: int) -> int:
    """Run the parent of `num_processes` gateways until SIGTERM/SIGINT; its exit code."""
    root = logging.getLogger()
    handler = setup_logging(settings.common)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe of a child
    try:
        return asyncio.run(GatewayPool(settings, num_processes).run())
    except OSError as exc:  # the internal port in use
        log.error("gateway pool failed: %s", exc)
        return EXIT_FAILED
    finally:
        root.removeHandler(handler)
