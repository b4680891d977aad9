"""This machine's identity: two processes share memory (CUDA IPC, a /dev/shm mapping) only when it is equal."""

from __future__ import annotations

import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """Hostname plus boot id: two hosts (or one host across a reboot) never share it."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
