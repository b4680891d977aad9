"""A whole local stack: a private nats-server and every service as a supervised child process.

    with Stack(port=0) as stack:                      # start() + wait_ready(start_timeout_s)
        client = openai.OpenAI(base_url=stack.base_url, api_key="none")
        stack.kill("decode-0", signal.SIGKILL)        # the supervisor restarts it with backoff

Children get their settings only through the environment (the same names `deepinfer config` lists): the NATS
URL and its generated token, the model, a generated data-plane secret, ids (`prefill-0`, ...), internal ports
picked here up front (so `/ready` can be polled) and data-plane ports 0 (any free port). Everything binds
127.0.0.1. Stop order: gateway, then workers, then schedulers, NATS last.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from deepinfer.config import (
    DEFAULT_MODEL,
    CommonSettings,
    DecodeSettings,
    GatewaySettings,
    KvCacheSettings,
    PrefillSettings,
    SchedulerSettings,
    derive_served_model_name,
    env_name,
)
from deepinfer.cpus import default_gateway_processes, default_num_schedulers
from deepinfer.nats_server import NatsServer, find_nats_server, free_port
from deepinfer.up.devices import WorkerDevice, count_nvidia_gpus, default_num_prefill, plan_devices
from deepinfer.up.probes import HttpReadyProbe, Probe, TcpGreetingProbe
from deepinfer.up.supervisor import ChildSpec, RestartPolicy, Supervisor, SupervisorError

HOST = "127.0.0.1"
NATS_NAME = "nats"
#: Stop tiers: the gateway drains first (its in-flight requests still need the workers), NATS goes last.
STOP_TIERS = {"gateway": 0, "prefill": 1, "decode": 1, "scheduler": 2, "kvcache": 2, NATS_NAME: 3}
DEFAULT_START_TIMEOUT_S = 300.0


def default_num_gateways(num_cpus: int | None = None) -> int:
    """Gateway processes sharing the API port: one per 4 usable cores, 1 to 4 (deepinfer.cpus, the rule a
    gateway with `processes` unset follows too)."""
    return default_gateway_processes(num_cpus)


class StackError(RuntimeError):
    """The stack cannot start (a service module is missing) or did not become ready."""


@dataclass(frozen=True)
class ServiceInfo:
    """One child of the stack as it is now: its service kind, pid (None while down), ports and log file."""

    name: str
    service: str
    pid: int | None
    internal_port: int | None
    log_path: Path
    num_restarts: int


def service_available(service: str) -> bool:
    """Whether `python -m services.<service>` can run in this installation."""
    try:
        return importlib.util.find_spec(f"services.{service}.main") is not None
    except ModuleNotFoundError:
        return False


class Stack:
    """nats-server + G gateways (one API port, SO_REUSEPORT) + K schedulers + S kvcache shards + N prefill +
    M decode workers, supervised.

    Lifecycle: `start()` → `wait_ready(timeout_s)` → serve (`base_url`, `kill()`, `restart_count()`) → `stop()`.
    As a context manager, entering does start() and wait_ready(start_timeout_s); leaving does stop().
    `port=0` picks a free API port. `log_dir=None` logs to a temporary directory removed by `stop()`.
    `base_env` is the environment the children inherit (None: this process's); `env_overrides` go last.
    `num_prefill=None`: `devices.default_num_prefill` (none on a single GPU, else one); `num_schedulers=None`:
    `cpus.default_num_schedulers` (two from 4 usable cores, else one).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "auto",
        port: int = 8000,
        num_prefill: int | None = None,
        num_decode: int = 1,
        num_schedulers: int | None = None,
        num_gateways: int | None = None,
        num_kvcache: int = 1,
        env_overrides: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        base_env: Mapping[str, str] | None = None,
        policy: RestartPolicy | None = None,
        grace_s: float = 30.0,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        num_gpus: int | None = None,
    ) -> None:
        if num_prefill is None:
            num_prefill = default_num_prefill(device, self._count_gpus(device, num_gpus))
        if num_schedulers is None:
            num_schedulers = default_num_schedulers()
        if min(num_prefill, num_decode) < 0 or num_schedulers < 1:
            raise ValueError("need num_prefill >= 0, num_decode >= 0 and num_schedulers >= 1")
        self.model = absolute_if_path(model)
        self.device = device
        self.port = port or free_port(HOST)
        self.num_prefill, self.num_decode, self.num_schedulers = num_prefill, num_decode, num_schedulers
        self.num_gateways = default_num_gateways() if num_gateways is None else num_gateways
        self.num_kvcache = num_kvcache
        if self.num_gateways < 1 or num_kvcache < 0:
            raise ValueError("need num_gateways >= 1 and num_kvcache >= 0")
        self.env_overrides = dict(env_overrides or {})
        self.start_timeout_s = start_timeout_s
        self._base_env = base_env
        self._num_gpus = num_gpus
        self._own_log_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-up-")) if log_dir is None else log_dir
        self.supervisor = Supervisor(self.log_dir, policy, grace_s)
        self.nats = NatsServer(host=HOST)
        self.data_plane_secret = _generate_data_plane_secret()
        self.internal_ports: dict[str, int] = {}
        self.kinds: dict[str, str] = {NATS_NAME: NATS_NAME}
        self.devices: dict[str, WorkerDevice] = {}
        self._started = False

    @staticmethod
    def _count_gpus(device: str, num_gpus: int | None) -> int:
        if num_gpus is not None:
            return num_gpus
        return count_nvidia_gpus() if device in ("auto", "cuda") else 0

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. http://127.0.0.1:8000/v1."""
        return f"http://{HOST}:{self.port}/v1"

    @property
    def trace_dir(self) -> Path:
        """Where the file span exporter writes when DEEPINFER_OTEL_EXPORTER=file and no directory is set."""
        return self.log_dir / "traces"

    @property
    def model_name(self) -> str:
        """The name clients put in requests (DEEPINFER_SERVED_MODEL_NAME if set, else derived from the model)."""
        key = env_name(CommonSettings, "served_model_name")
        return self._env_value(key) or derive_served_model_name(self.model)

    @property
    def gateway_waits_for_workers(self) -> bool:
        """The gateway's /ready needs a decode worker (without a prefill worker it computes prompts itself);
        without local decode workers only /health is waited for."""
        return self.num_decode > 0

    @property
    def services(self) -> dict[str, ServiceInfo]:
        """Every child by name (nats, gateway-0, scheduler-0, prefill-0, decode-0, ...)."""
        sup = self.supervisor
        return {
            name: ServiceInfo(
                name,
                self.kinds[name],
                sup.pid(name),
                self.internal_ports.get(name),
                sup.log_path(name),
                sup.restart_count(name),
            )
            for name in sup.names
        }

    def start(self) -> None:
        """Plan ports and devices, then spawn nats-server and every service (does not wait for readiness)."""
        if self._started:
            return
        for service, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            if count and not service_available(service):
                raise StackError(
                    f"services.{service} is not available in this installation (asked for {count})"
                )
        self._started = True
        for spec in self.plan():
            self.supervisor.add(spec)
        try:
            self.supervisor.start()
        except SupervisorError as exc:
            raise StackError(str(exc)) from exc

    def wait_ready(
        self,
        timeout_s: float | None = None,
        on_ready: Callable[[str, float], None] | None = None,
        on_waiting: Callable[[dict[str, str], float], None] | None = None,
    ) -> dict[str, float]:
        """Block until every service answers ready (name -> seconds); StackError naming who did not."""
        try:
            return self.supervisor.wait_ready(timeout_s or self.start_timeout_s, on_ready, on_waiting)
        except SupervisorError as exc:
            raise StackError(str(exc)) from exc

    def stop(self) -> None:
        """Stop every child in order (SIGTERM, SIGKILL after the grace period); idempotent."""
        if self._started:
            self._started = False
            self.supervisor.stop()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def add_gateway(self, name: str, env_overrides: Mapping[str, str] | None = None) -> str:
        """One more gateway over the same NATS and workers (its own API port and settings); its base URL.

        The supervisor spawns it at once; `wait_ready()` then includes it. Use: another gateway's settings
        (e.g. a short request_timeout_s) side by side with the default one.
        """
        if not self._started:
            raise StackError("add_gateway needs a started stack")
        port = free_port(HOST)
        fields = {"gateway_id": name, "host": HOST, "port": str(port), "processes": "1"}
        cpu_only = not any(d.device.startswith("cuda") for d in self.devices.values())
        spec = self._spec("gateway", name, self._common_env(cpu_only), fields, "/ready", env_overrides or {})
        self.supervisor.add(spec)
        return f"http://{HOST}:{port}/v1"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one child (e.g. "decode-0"); the supervisor restarts it as after any crash."""
        self.supervisor.kill(name, sig)

    def restart_count(self, name: str) -> int:
        """How often `name` was restarted after an unexpected exit."""
        return self.supervisor.restart_count(name)

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def plan(self) -> list[ChildSpec]:
        """The children `start()` spawns, NATS first: argv, environment, stop tier, probe (ports picked now)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return [self._nats_spec(), *self._service_specs()]

    def _nats_spec(self) -> ChildSpec:
        config_path = self.log_dir / "nats-server.conf"
        config_path.write_text(self.nats.config_text())
        config_path.chmod(0o600)  # it holds the token
        argv = (str(find_nats_server()), "-c", str(config_path))
        probe = TcpGreetingProbe(HOST, self.nats.port)
        return ChildSpec(NATS_NAME, argv, self._base(), STOP_TIERS[NATS_NAME], probe, liveness=probe)

    def _service_specs(self) -> list[ChildSpec]:
        workers = [("prefill", i) for i in range(self.num_prefill)] + [
            ("decode", i) for i in range(self.num_decode)
        ]
        num_gpus = self._num_gpus
        if num_gpus is None and self.device in ("auto", "cuda") and workers:
            num_gpus = count_nvidia_gpus()
        self.devices = dict(
            zip(
                (f"{s}-{i}" for s, i in workers),
                plan_devices(self.device, len(workers), num_gpus or 0),
                strict=True,
            )
        )
        common = self._common_env(
            cpu_only=not any(d.device.startswith("cuda") for d in self.devices.values())
        )
        specs = [
            self._spec("scheduler", f"scheduler-{k}", common, {"scheduler_id": f"scheduler-{k}"})
            for k in range(self.num_schedulers)
        ]
        # Store shards keep their data under DEEPINFER_DATA_DIR (<data_dir>/kvcache/<shard>): it outlives the stack.
        specs += [
            self._spec("kvcache", f"kvcache-{k}", common,
                       {"shard": str(k), "data_plane_host": HOST, "data_plane_port": "0"})
            for k in range(self.num_kvcache)
        ]
        for service, index in workers:
            specs.append(self._worker_spec(service, f"{service}-{index}", common))
        probe_path = "/ready" if self.gateway_waits_for_workers else "/health"
        reuse_port = "true" if self.num_gateways > 1 else "false"
        for index in range(self.num_gateways):
            name = f"gateway-{index}"
            # Each entry is one process (processes=1): up supervises them itself.
            fields = {"gateway_id": name, "host": HOST, "port": str(self.port), "reuse_port": reuse_port,
                      "processes": "1"}
            specs.append(self._spec("gateway", name, common, fields, probe_path))
        return specs

    def _worker_spec(self, service: str, name: str, common: dict[str, str]) -> ChildSpec:
        plan = self.devices[name]
        fields = {"worker_id": name, "data_plane_host": HOST, "data_plane_port": "0", "device": plan.device}
        if plan.gpu_memory_utilization is not None:
            fields["gpu_memory_utilization"] = f"{plan.gpu_memory_utilization:.3f}"
        return self._spec(service, name, common, fields)

    def _spec(
        self,
        service: str,
        name: str,
        common: dict[str, str],
        fields: dict[str, str],
        probe_path: str = "/ready",
        env_overrides: Mapping[str, str] | None = None,
    ) -> ChildSpec:
        cls = _SETTINGS[service]
        port = free_port(HOST)
        self.internal_ports[name] = port
        self.kinds[name] = service
        env = {**common, **{env_name(cls, key): value for key, value in fields.items()}}
        env[env_name(cls, "internal_port")] = str(port)
        env.update(self.env_overrides)
        env.update(env_overrides or {})
        argv = (sys.executable, "-m", f"services.{service}")
        probe: Probe = HttpReadyProbe(f"http://{HOST}:{port}{probe_path}")
        liveness = HttpReadyProbe(f"http://{HOST}:{port}/health")  # 200 while the process works, ready or not
        return ChildSpec(name, argv, env, STOP_TIERS[service], probe, liveness=liveness)

    def _base(self) -> dict[str, str]:
        return dict(os.environ if self._base_env is None else self._base_env)

    def _env_value(self, key: str) -> str | None:
        return self.env_overrides.get(key) or self._base().get(key) or None

    def _common_env(self, cpu_only: bool) -> dict[str, str]:
        env = self._base()
        env.setdefault(env_name(CommonSettings, "log_format"), "text")  # a terminal, not a log pipeline
        env["PYTHONUNBUFFERED"] = "1"
        if cpu_only and self.devices and "OMP_NUM_THREADS" not in env:
            # N CPU workers share the cores instead of each taking them all.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(self.devices)))
        values = {
            "nats_url": self.nats.url,
            "nats_token": self.nats.token,
            "model": self.model,
            "data_plane_secret": self.data_plane_secret,
            "internal_host": HOST,
        }
        env.update({env_name(CommonSettings, key): value for key, value in values.items()})
        exporter, file_dir = env_name(CommonSettings, "otel_exporter"), env_name(CommonSettings, "otel_file_dir")
        if self._env_value(exporter) == "file" and not self._env_value(file_dir):
            env[file_dir] = str(self.trace_dir)  # spans beside the logs
        return env


_SETTINGS = {
    "gateway": GatewaySettings,
    "kvcache": KvCacheSettings,
    "scheduler": SchedulerSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
}


def _generate_data_plane_secret() -> str:
    from deepinfer.dataplane import generate_secret

    return generate_secret()


def absolute_if_path(model: str) -> str:
    """A model that names an existing file or directory becomes absolute (children may run elsewhere)."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model
