"""`deepinfer up`: a private nats-server and every service as supervised child processes on this machine."""

from deepinfer.up.probes import HttpReadyProbe, ProbeResult, TcpGreetingProbe
from deepinfer.up.stack import ServiceInfo, Stack, StackError, service_available
from deepinfer.up.supervisor import ChildSpec, RestartEvent, RestartPolicy, Supervisor, SupervisorError

__all__ = [
    "ChildSpec",
    "HttpReadyProbe",
    "ProbeResult",
    "RestartEvent",
    "RestartPolicy",
    "ServiceInfo",
    "Stack",
    "StackError",
    "Supervisor",
    "SupervisorError",
    "TcpGreetingProbe",
    "service_available",
]
