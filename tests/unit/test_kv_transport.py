"""Which path a store get takes per shard (deepinfer.kvcache.client.transport.path_for), and the transfer engine's
lazy import: everything runs without the library, and says why it is missing."""

from __future__ import annotations

import pytest

from deepinfer.kvcache.client import KvTransport, Shard
from deepinfer.kvcache.client.transport import handoff_path, path_for

HERE = "host-a/boot-1"


def _shard(host_id: str, *, shm: bool, transfer_engine: bool) -> Shard:
    return Shard("s0", "10.0.0.2:8105", 0.0, host_id, shm, transfer_engine)


@pytest.mark.parametrize(("transport", "host_id", "shm", "te", "loads", "path"), [
    (KvTransport.AUTO, HERE, True, True, True, "shm"),                       # same host: shared memory first
    (KvTransport.AUTO, HERE, False, True, True, "dataplane"),                # same host never takes the TE in auto
    (KvTransport.AUTO, "host-b/boot-9", True, True, True, "transfer_engine"),
    (KvTransport.AUTO, "host-b/boot-9", True, True, False, "dataplane"),     # the library does not load here
    (KvTransport.AUTO, "host-b/boot-9", True, False, True, "dataplane"),     # the shard serves no TE
    (KvTransport.DATAPLANE, HERE, True, True, True, "dataplane"),
    (KvTransport.DATAPLANE, "host-b/boot-9", True, True, True, "dataplane"),
    (KvTransport.MOONCAKE, HERE, True, True, True, "transfer_engine"),       # one machine standing in for two
    (KvTransport.MOONCAKE, HERE, True, False, True, "dataplane"),
    (KvTransport.MOONCAKE, "", False, True, False, "dataplane"),
])
def test_path_for_each_transport_and_shard(transport, host_id, shm, te, loads, path):
    assert path_for(transport, _shard(host_id, shm=shm, transfer_engine=te), HERE, loads) == path


def test_without_the_library_the_engine_says_why(monkeypatch):
    from deepinfer.dataplane import transfer_engine
    from deepinfer.dataplane.transfer_engine import TransferEngine, TransferEngineUnavailable, availability

    def no_ibverbs(name: str):
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(transfer_engine.importlib, "import_module", no_ibverbs)
    monkeypatch.setattr(TransferEngine, "_shared", None)
    assert "apt-get install libibverbs1" in availability()
    with pytest.raises(TransferEngineUnavailable, match="libibverbs1"):
        TransferEngine.shared("127.0.0.1")

    def no_libcurl(name: str):  # a minimal image: libibverbs1 installed, libcurl4 not (docker/install.sh has both)
        raise ImportError("libcurl.so.4: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(transfer_engine.importlib, "import_module", no_libcurl)
    assert availability().endswith("; apt-get install libcurl4")


@pytest.mark.parametrize(("transport", "owner_host_id", "te", "loads", "path"), [
    (KvTransport.AUTO, "host-b/boot-9", True, True, "transfer_engine"),   # an owner on another host
    (KvTransport.AUTO, HERE, True, True, "dataplane"),                    # same host: never the TE in auto
    (KvTransport.AUTO, "host-b/boot-9", False, True, "dataplane"),        # the owner leases to no TE
    (KvTransport.AUTO, "host-b/boot-9", True, False, "dataplane"),        # the library does not load here
    (KvTransport.MOONCAKE, HERE, True, True, "transfer_engine"),
    (KvTransport.DATAPLANE, "host-b/boot-9", True, True, "dataplane"),
])
def test_handoff_path_follows_the_same_rules(transport, owner_host_id, te, loads, path):
    from deepinfer.protocol import KvHandle, KvLayout

    layout = KvLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    handle = KvHandle(request_id="r", block_hashes=[b"h" * 16], block_ids=[3, 4], num_tokens=6, owner_worker_id="p",
                      data_plane_address="10.0.0.3:8103", layout=layout, layout_id=layout.layout_id(),
                      lease_expires_at_unix_s=0.0, transfer_engine=te, host_id=owner_host_id)
    assert handoff_path(transport, handle, HERE, loads) == path
