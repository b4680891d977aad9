"""`TransferEngine`: KV bytes between hosts through Mooncake Transfer Engine (TCP here, RDMA where a cluster has it).

The library (`mooncake-transfer-engine-non-cuda` / `-cuda13`, the `transfer-engine` extra; it needs
`libibverbs1`, `libnuma1` and `libcurl4` even for TCP) is imported lazily, on the first engine built: everything else runs without it, and
`availability()` says why it is missing.

    engine = TransferEngine.start(hostname="10.0.0.5")   # one per process: P2PHANDSHAKE metadata, no etcd
    engine.register(address, length)                        # memory a peer may read or write (once, up front)
    engine.session_id                                       # "10.0.0.5:<rpc port>": what a peer names us by
    engine.read(peer_session_id, [Transfer(local, remote, length), ...])   # one batch, blocks until done

What the library does (0.3.13.post1, read from its bindings; `mooncake.engine.TransferEngine`):

- `initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)` → 0; the metadata of each segment is
  exchanged peer to peer on the engine's RPC port (`get_rpc_port()`), so a session id is `host:rpc_port`;
- `register_memory(addr, length)` / `unregister_memory(addr)` → 0: only registered memory is served to peers
  (a read outside it is refused by the serving side); a local buffer must be registered for RDMA (TCP copies
  from anywhere, we register anyway);
- `batch_transfer_sync_read|write(session, local_addrs, remote_addrs, lengths)` → 0 or a negative code; the
  batch's parts run in parallel, in no stated order;
- it logs through glog to stderr; errors are return codes, never exceptions.

**No authentication.** Any process that reaches the engine's ports may read and write every registered byte of
this process by its address: the engine listens on all interfaces (its RPC port and its TCP transport's port,
both chosen at start; `MC_TCP_BIND_ADDRESS` did not change that). Peers learn a session id and addresses only
in replies on the authenticated data plane; the network (the chart's NetworkPolicy) confines who can connect.
Register only what peers are meant to read (docs/dataplane.md, "Transfer engine").
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.dataplane.errors import DataPlaneError

#: What `start` accepts as `protocol` (the library also has NVLink / EFA / CXL transports, not wired here).
PROTOCOLS = ("tcp", "rdma")
#: The Debian package of each library the wheels' engine.so links that a minimal system may lack (the CUDA build's
#: libmlx5 included; docker/install.sh installs them).
LIBRARY_PACKAGES = {"libibverbs": "libibverbs1", "libnuma": "libnuma1", "libcurl": "libcurl4",
                    "libmlx5": "ibverbs-providers"}


class TransferEngineUnavailable(DataPlaneError):
    """The transfer engine cannot be loaded here (the extra is not installed, or a library it links is missing)."""

    code = "transfer_engine_unavailable"


class TransferFailed(DataPlaneError):
    """A transfer, a registration or the engine's start returned an error code."""

    code = "transfer_failed"


@dataclass(frozen=True, slots=True)
class Transfer:
    """One contiguous copy between a local address and a peer's registered address."""

    local_address: int
    remote_address: int
    length: int


def availability() -> str:
    """"" when the engine can be loaded here, else why not (for a test's skip reason and a startup log)."""
    try:
        _module()
    except TransferEngineUnavailable as exc:
        return str(exc)
    return ""


def _module() -> Any:
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:  # no wheel, or the wheel's engine.so without a library it links
        packages = [package for library, package in LIBRARY_PACKAGES.items() if library in str(exc)]
        hint = (f"apt-get install {' '.join(packages)}" if packages
                else "pip install 'deepinfer[transfer-engine]' (mooncake-transfer-engine-non-cuda)")
        raise TransferEngineUnavailable(f"Mooncake Transfer Engine not loadable ({exc}); {hint}") from exc


def buffer_address(buffer: Any) -> tuple[int, int]:
    """(address, length in bytes) of a C-contiguous buffer (numpy array, memoryview, mmap slice)."""
    array = np.frombuffer(buffer, np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    if not array.flags.c_contiguous:
        raise ValueError("a transfer buffer must be C-contiguous")
    return array.ctypes.data, array.nbytes


class TransferEngine:
    """This process's transfer engine: registered memory and batched reads / writes to peers' memory.

    Lifecycle: `start()` (one per process: `shared()` hands out the one) → `register` what peers may reach →
    `read` / `write` from any thread (each call blocks until its batch is done: run it off the event loop) →
    `close()` unregisters everything (the library has no shutdown of its own; its threads live on).
    """

    _shared: TransferEngine | None = None
    _shared_lock = threading.Lock()

    def __init__(self, engine: Any, hostname: str, protocol: str) -> None:
        self._engine = engine
        self.hostname, self.protocol = hostname, protocol
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> length
        self._lock = threading.Lock()

    @classmethod
    def start(cls, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> TransferEngine:
        """A new engine named `hostname` (the address peers reach this host by: the pod IP in Kubernetes)."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        engine = _module().TransferEngine()
        code = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if code != 0:
            raise TransferFailed(f"transfer engine did not start on {hostname} over {protocol} (code {code})")
        return cls(engine, hostname, protocol)

    @classmethod
    def shared(cls, hostname: str = "127.0.0.1", protocol: str = "tcp") -> TransferEngine:
        """The process's one engine, started on first use (the library keeps process-wide state: its RPC port,
        its logging; a second engine would be a second set of ports to confine for nothing)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls.start(hostname, protocol)
            elif (cls._shared.hostname, cls._shared.protocol) != (hostname, protocol):
                raise ValueError(f"this process's transfer engine is {cls._shared.session_id} over "
                                 f"{cls._shared.protocol}, not {hostname} over {protocol}")
            return cls._shared

    # -- memory -------------------------------------------------------------------------------------------------
    def register(self, address: int, length: int) -> None:
        """Let peers read / write [address, address + length) (idempotent for the same range)."""
        with self._lock:
            if self._registered.get(address) == length:
                return
            code = self._engine.register_memory(address, length)
            if code != 0:
                raise TransferFailed(f"registering {length} bytes at {address:#x} failed (code {code})")
            self._registered[address] = length

    def register_buffer(self, buffer: Any) -> tuple[int, int]:
        """Register a buffer's memory (the caller keeps it alive until `unregister`); its (address, length)."""
        address, length = buffer_address(buffer)
        self.register(address, length)
        return address, length

    def unregister(self, address: int) -> None:
        """Stop serving the range registered at `address` (unknown: nothing)."""
        with self._lock:
            if self._registered.pop(address, None) is None:
                return
            code = self._engine.unregister_memory(address)
        if code != 0:
            raise TransferFailed(f"unregistering {address:#x} failed (code {code})")

    # -- transfers ----------------------------------------------------------------------------------------------
    def read(self, session_id: str, transfers: Sequence[Transfer]) -> None:
        """Copy each transfer's remote bytes (the peer's registered memory) to its local address; blocks."""
        self._batch(session_id, transfers, write=False)

    def write(self, session_id: str, transfers: Sequence[Transfer]) -> None:
        """Copy each transfer's local bytes to its remote address in the peer's registered memory; blocks."""
        self._batch(session_id, transfers, write=True)

    def _batch(self, session_id: str, transfers: Sequence[Transfer], *, write: bool) -> None:
        if not transfers:
            return
        local = [t.local_address for t in transfers]
        remote = [t.remote_address for t in transfers]
        lengths = [t.length for t in transfers]
        op = self._engine.batch_transfer_sync_write if write else self._engine.batch_transfer_sync_read
        code = op(session_id, local, remote, lengths)
        if code != 0:
            verb = "write to" if write else "read from"
            raise TransferFailed(f"transfer engine: {len(transfers)} transfer(s), {sum(lengths)} bytes, "
                                 f"{verb} {session_id} failed (code {code})")

    def close(self) -> None:
        """Unregister every range (the engine itself lives as long as the process)."""
        with self._lock:
            addresses, self._registered = list(self._registered), {}
        for address in addresses:
            self._engine.unregister_memory(address)
