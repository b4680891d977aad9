"""Free TCP ports for the servers a stack starts (`deepinfer up`, the tests' stacks).

A port the OS hands out for `bind(port 0)` comes from its ephemeral range, the same range it takes outgoing
connections' local ports from. Between choosing a port and the server's bind (a process start later), any
outgoing connection on the host (a NATS client, an HTTP client) can take it, and the server then fails with
EADDRINUSE at every restart for as long as that connection lives. So ports come from just below the ephemeral
range, where the OS never puts an outgoing connection, each checked free and never handed out twice by one
process; the OS's choice only when that range has none.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Ports below the ephemeral range to draw from; the range used where the OS does not say (macOS: 49152+).
LISTEN_SPAN = 10_000
_DEFAULT_RANGE = (22_768, 32_768)
_ATTEMPTS = 64

_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)  # a forked child draws its own ports


def listen_range() -> tuple[int, int]:
    """[low, high): the ports below the OS's ephemeral range (Linux), else a default span."""
    try:
        start = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_RANGE
    return max(1024, start - LISTEN_SPAN), start


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, outside the ephemeral range when one is free there."""
    low, high = listen_range()
    with _lock:
        if high > low:
            for port in _rng.sample(range(low, high), min(_ATTEMPTS, high - low)):
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        _handed_out.add(port)
        return port
