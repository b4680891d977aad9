"""The lifecycle every service's `main.py` uses, so that a main only wires (docs/architecture.md §9, STYLE.md).

    def main() -> int:
        return service_main(SchedulerSettings, build)      # build(ctx) -> a Handler

`Service.run` does, in order: logging → tracing → a Prometheus registry → `Bus.connect` (credentials and TLS
from settings.common) → `build(ctx)` → the internal HTTP server (/health, /ready, /metrics) → `handler.start()`
→ one "started" log line (ids, NATS URL without credentials, ports actually bound) → wait for SIGTERM/SIGINT →
readiness off → `handler.drain(grace_s)` → bus drain → internal server stop → `handler.close()` → exit 0.
A second signal during the drain cuts the grace period short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry

from deepinfer.bus import MessageBus
from deepinfer.config import CommonSettings, ServiceSettings, load_settings

S = TypeVar("S", bound=ServiceSettings)

log = logging.getLogger(__name__)

#: Exit status of a clean stop, and of a service that failed to start or crashed.
EXIT_OK = 0
EXIT_FAILED = 1

#: Past the grace, the time a handler gets to end what is left (error events, aborts, their publishes).
DRAIN_OVERRUN_S = 5.0

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@runtime_checkable
class Handler(Protocol):
    """What a service's `build(ctx)` returns: the thing that takes work off the bus.

    Lifecycle (driven by `Service.run`, never by the handler itself):
      built (no work taken yet) → `await start()` (subscribe, start background tasks) → serving, while
      `is_ready()` is polled by /ready (`not_ready_reason()` explains a False) → on SIGTERM the runtime turns
      readiness off, then `await drain(grace_s)`: stop taking new work and finish in-flight work within
      `grace_s` → the runtime drains the bus (handlers in progress finish) → `await close()`: release
      everything (idempotent; also called when start() failed).
    `is_ready` and `not_ready_reason` must be cheap and must not block: they run on every probe.
    """

    async def start(self) -> None:
        """Subscribe and start background work; raise to abort the service's start."""
        ...

    async def drain(self, grace_s: float) -> None:
        """Stop taking new work; return once in-flight work is done or `grace_s` has passed."""
        ...

    async def close(self) -> None:
        """Release everything; safe to call twice and after a failed start."""
        ...

    def is_ready(self) -> bool:
        """Whether the handler can serve now."""
        ...

    def not_ready_reason(self) -> str:
        """Why `is_ready()` is False (a short phrase for /ready)."""
        ...


@dataclass
class ServiceContext(Generic[S]):
    """What `build(ctx)` gets: the settings and the runtime's shared objects."""

    name: str
    settings: S
    bus: MessageBus
    registry: CollectorRegistry
    tracer: Any  # opentelemetry.trace.Tracer
    #: Ports the service bound besides the internal one (API, data plane), for the "started" log line.
    ports: dict[str, int] = field(default_factory=dict)
    #: The internal HTTP port actually bound; set before `handler.start()` (None while building).
    internal_port: int | None = None

    @property
    def internal_address(self) -> str:
        """"host:port" of /health, /ready, /metrics (for heartbeats); "" before the server is bound."""
        if self.internal_port is None:
            return ""
        return f"{self.settings.common.internal_host}:{self.internal_port}"

    def advertise_port(self, name: str, port: int) -> None:
        """Record a port the handler bound (the real one when 0 was asked), reported at start."""
        self.ports[name] = port


#: `build(ctx)`: construct the service's handler (not started yet).
Build = Callable[[ServiceContext[S]], Awaitable[Handler]]
#: `connect(common, client_name)`: a connected MessageBus (tests pass one returning a FakeBus).
BusFactory = Callable[[CommonSettings, str], Awaitable[MessageBus]]


async def connect_bus(common: CommonSettings, client_name: str) -> MessageBus:
    """`Bus.connect` with the URL, token or user/password, and TLS files of `common`."""
    from deepinfer.bus import Bus

    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value is not None else None

    def path(value: Any) -> str | None:
        return str(value) if value is not None else None

    return await Bus.connect(
        common.nats_url,
        name=client_name,
        token=secret(common.nats_token),
        user=common.nats_user,
        password=secret(common.nats_password),
        tls_ca=path(common.nats_tls_ca),
        tls_cert=path(common.nats_tls_cert),
        tls_key=path(common.nats_tls_key),
    )


def redact_url(urls: str) -> str:
    """NATS URL(s) without credentials: nats://user:pw@host:4222 -> nats://host:4222 (comma lists kept)."""
    parts = []
    for url in urls.split(","):
        split = urlsplit(url.strip())
        netloc = split.netloc.rpartition("@")[2]
        parts.append(urlunsplit(split._replace(netloc=netloc)))
    return ",".join(parts)


def service_ids(settings: ServiceSettings) -> dict[str, str]:
    """The identity fields of a settings object (`*_id`, `shard`), for logs."""
    names = [name for name in type(settings).model_fields if name.endswith("_id") or name == "shard"]
    return {name: str(getattr(settings, name)) for name in names}


class Service(Generic[S]):
    """Runs one service from settings and a `build` function; see the module docstring for the order.

    `started` is set once the handler has started and the signal handlers are installed; `internal_port` is
    the bound internal port (the real one when settings ask for 0). `stop()` does what SIGTERM does.
    `drain_grace_s` None = the settings' own.
    """

    def __init__(
        self,
        settings: S,
        build: Build[S],
        *,
        name: str | None = None,
        drain_grace_s: float | None = None,
        connect: BusFactory = connect_bus,
        install_signal_handlers: bool = True,
    ) -> None:
        self.settings = settings
        self.name = name or type(settings).service
        self.drain_grace_s = settings.drain_grace_s if drain_grace_s is None else drain_grace_s
        self.started = asyncio.Event()
        self.internal_port: int | None = None
        self._build = build
        self._connect = connect
        self._install_signal_handlers = install_signal_handlers
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping = False
        self._handler: Handler | None = None
        self._bus: MessageBus | None = None

    def stop(self) -> None:
        """Begin a graceful stop (as SIGTERM); a second call cuts the drain's grace period short."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    def is_ready(self) -> bool:
        """Ready = started, not stopping, bus connected, and the handler says so."""
        return self._not_ready_reason() is None

    def not_ready_reason(self) -> str:
        """Why the service is not ready ("" when it is)."""
        return self._not_ready_reason() or ""

    def _not_ready_reason(self) -> str | None:
        if self._stopping:
            return "stopping: draining in-flight work"
        if self._handler is None or not self.started.is_set():
            return "starting"
        # Bus has is_connected; a bus without it (FakeBus) counts as connected.
        if not getattr(self._bus, "is_connected", True):
            return "NATS connection lost (reconnecting)"
        if not self._handler.is_ready():
            return self._handler.not_ready_reason() or f"{self.name} handler not ready"
        return None

    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT or `stop()`, drain, and return the exit code (0 = clean)."""
        from deepinfer.telemetry import setup_logging

        root = logging.getLogger()
        log_handler = setup_logging(self.settings.common)
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start(stack)
                await self._stop.wait()
                await self._shutdown()
            log.info("%s stopped", self.name, extra={"service": self.name})
            return EXIT_OK
        except Exception as exc:
            log.error("%s failed: %s", self.name, exc, exc_info=not _is_expected_failure(exc))
            return EXIT_FAILED
        finally:
            root.removeHandler(log_handler)

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        from deepinfer.telemetry import internal_app, new_registry, serve_internal, setup_tracer_provider
        from deepinfer.telemetry.tracing import count_dropped_spans

        common = self.settings.common
        if self._install_signal_handlers:
            self._add_signal_handlers(stack)
        provider = setup_tracer_provider(common, self.name)
        stack.callback(provider.shutdown)
        registry = new_registry()
        count_dropped_spans(registry)
        ids = service_ids(self.settings)
        self._bus = bus = await self._connect(common, next(iter(ids.values()), self.name))
        stack.push_async_callback(bus.close)  # a no-op after the drain in _shutdown
        tracer = provider.get_tracer(f"deepinfer.{self.name}")
        ctx = ServiceContext(self.name, self.settings, bus, registry, tracer)
        self._handler = handler = await self._build(ctx)
        stack.push_async_callback(handler.close)
        app = internal_app(registry, self.is_ready, self.name, self.not_ready_reason,
                           getattr(handler, "unhealthy_reason", None))
        internal = await serve_internal(app, common.internal_host, self.settings.internal_port)
        stack.push_async_callback(internal.stop)
        self.internal_port = ctx.internal_port = internal.port
        await handler.start()
        self._log_started(ids, {"internal": internal.port, **ctx.ports})
        self.started.set()

    def _log_started(self, ids: dict[str, str], ports: dict[str, int]) -> None:
        nats_url = redact_url(self.settings.common.nats_url)
        fields = [f"{key}={value}" for key, value in ids.items()]
        fields += [f"{key}_port={port}" for key, port in ports.items()]
        log.info(
            "%s started: %s nats=%s",
            self.name,
            " ".join(fields),
            nats_url,
            extra={"service": self.name, "ids": ids, "nats_url": nats_url, "ports": ports},
        )

    def _add_signal_handlers(self, stack: contextlib.AsyncExitStack) -> None:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
            stack.callback(loop.remove_signal_handler, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        again = self._stop.is_set()
        log.info("%s: %s received%s", self.name, sig.name, ", stopping now" if again else ", draining")
        self.stop()

    async def _shutdown(self) -> None:
        """Readiness off → handler drain (bounded; a second signal cuts it) → bus drain."""
        assert self._handler is not None and self._bus is not None
        self._stopping = True
        started_s = time.monotonic()
        drain = asyncio.ensure_future(self._handler.drain(self.drain_grace_s))
        force = asyncio.ensure_future(self._force.wait())
        # Past the grace the handler ends what is left (a gateway's error events, a worker's aborts): a few seconds.
        done, _ = await asyncio.wait(
            {drain, force}, timeout=self.drain_grace_s + DRAIN_OVERRUN_S, return_when=asyncio.FIRST_COMPLETED
        )
        force.cancel()
        if drain not in done:
            drain.cancel()
            log.warning("%s: drain cut short after %.1f s", self.name, time.monotonic() - started_s)
        with contextlib.suppress(asyncio.CancelledError):
            await drain  # re-raises a drain failure
        await self._bus.drain()
        log.info("%s drained in %.2f s", self.name, time.monotonic() - started_s)


def _is_expected_failure(exc: Exception) -> bool:
    """Failures that one line explains (no traceback): NATS unreachable or refused, a port in use."""
    from deepinfer.bus import BusConnectError
    from deepinfer.telemetry import TelemetryError

    return isinstance(exc, BusConnectError | OSError | TelemetryError)


async def run_service(settings: S, build: Build[S], **options: Any) -> int:
    """Run one service until SIGTERM/SIGINT; returns the exit code. `options` go to `Service`."""
    return await Service(settings, build, **options).run()


def service_main(settings_cls: type[S], build: Build[S], **options: Any) -> int:
    """A service's sync entry point: settings from the environment (exit 2 on a bad value), then run."""
    settings = load_settings(settings_cls)
    sys.setswitchinterval(settings.gil_switch_interval_s)
    return asyncio.run(run_service(settings, build, **options))
