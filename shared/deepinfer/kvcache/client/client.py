"""`KvStoreClient`: a worker's view of the kvcache store — has / get / put of many blocks, each on the shard
that rendezvous hashing of its hash picks among the live shards (deepinfer.kvcache.rendezvous).

    blocks ─ group_by_shard(hashes, live shards) ─► one data-plane request per shard, all shards concurrently
                                                   (reads and writes on separate connections: a write-behind put
                                                   never queues a load behind it; admission lookups on a third)
    get: on the event loop, each shard's blocks received straight into the caller's buffers when given
    put: on writer threads (one per shard at a time), over blocking sockets: the blocks' bytes go from the
         caller's buffers (write-behind: views of pinned host slots) to the kernel, no copy, not on the loop

A shard on this host whose RAM tier is shared memory (its heartbeat: our host id, `shm`) serves a get through the
mapping instead of the socket (deepinfer.kvcache.client.local); a shard on another host that serves its RAM tier to
transfer engines (`transfer_engine`) through Mooncake Transfer Engine (deepinfer.kvcache.client.remote). Which one
is `transport` (deepinfer.kvcache.client.transport); any failure falls back to the data-plane get.

A shard that is down, slow or gone turns its blocks into misses for `has` (never an error); `get` is all or
nothing like the data plane and raises, so the caller recomputes. Methods run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from deepinfer import subjects
from deepinfer.bus import MessageBus, Subscriptions
from deepinfer.dataplane import DataPlaneClient, DataPlaneConnectionError, DataPlaneError
from deepinfer.dataplane.blocking import BlockingPutClient
from deepinfer.dataplane.frames import BytesLike
from deepinfer.dataplane.transfer_engine import TransferEngineUnavailable
from deepinfer.host_identity import host_id as this_host_id
from deepinfer.kvcache.client.local import SharedMemoryReads, SlotDestination
from deepinfer.kvcache.client.remote import TransferEngineReads
from deepinfer.kvcache.client.shards import Shard, ShardSet
from deepinfer.kvcache.client.transport import KvTransport, LeasedReads, path_for
from deepinfer.kvcache.rendezvous import group_by_shard
from deepinfer.protocol import KvStoreHeartbeat

log = logging.getLogger(__name__)

#: Writer threads: puts to this many shards run at once.
PUT_THREADS = 4


class StoreUnavailable(DataPlaneError):
    """No live shard holds (or could take) these blocks."""


class KvStoreClient:
    """Client of every live store shard; `start(bus)` follows their heartbeats."""

    def __init__(self, secret: str | bytes | None, timeout_s: float, shard_lease_s: float,
                 shards: ShardSet | None = None, host_id: str | None = None,
                 transport: KvTransport = KvTransport.AUTO, transfer_engine_host: str = "127.0.0.1") -> None:
        self.secret = secret
        self.timeout_s = timeout_s
        self.shards = shards or ShardSet(shard_lease_s)
        self._clients: dict[tuple[str, str], DataPlaneClient] = {}
        self._putters: dict[str, BlockingPutClient] = {}
        self._put_threads = ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="kvstore-put")
        self._subscriptions: Subscriptions | None = None
        #: Gets from shards on this host (`host_id`: this machine's unless a test says otherwise).
        self.shared_memory = SharedMemoryReads(this_host_id() if host_id is None else host_id)
        #: Gets from shards that serve a transfer engine (`transfer_engine_host`: how peers reach this host).
        self.transport = KvTransport(transport)
        self.transfer_engine = TransferEngineReads(transfer_engine_host)
        self._transfer_engine_error = "" if self.transport != KvTransport.DATAPLANE else "not used"

    async def start(self, bus: MessageBus) -> None:
        """Follow the shards' heartbeats on di.kvcache.heartbeat.*."""
        self._subscriptions = Subscriptions(bus)
        await self._subscriptions.subscribe("heartbeats", subjects.kvcache_heartbeat_all(), self._on_heartbeat,
                                            message_type=KvStoreHeartbeat)

    async def close(self) -> None:
        """Stop following heartbeats; close every connection."""
        if self._subscriptions is not None:
            await self._subscriptions.close()
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        putters, self._putters = list(self._putters.values()), {}
        for putter in putters:
            putter.close()
        self._put_threads.shutdown(wait=False, cancel_futures=True)
        self.shared_memory.close()
        self.transfer_engine.close()

    def has_shards(self) -> bool:
        """True while at least one shard is live."""
        return bool(self.shards.live())

    def all_shared_memory(self) -> bool:
        """True when every live shard is on this host with its RAM tier in shared memory: gets skip the socket
        (unless one falls back)."""
        shards = self.shards.live().values()
        return bool(shards) and all(self._same_host_shm(s) for s in shards)

    async def has(self, layout_id: str, block_hashes: Sequence[bytes], connection: str = "read") -> list[bool]:
        """One flag per block: held by its shard. A shard that fails answers False for its blocks. `connection`
        names the connection to each shard it goes on ("read", with the gets; admission lookups use their own,
        so they never wait behind a load's MiBs or a write-behind's has)."""
        present = [False] * len(block_hashes)
        groups = self._groups(block_hashes)

        async def ask(shard: Shard, indexes: list[int]) -> None:
            flags = await self._client(shard, connection).has_blocks(layout_id, [block_hashes[i] for i in indexes])
            for i, flag in zip(indexes, flags, strict=True):
                present[i] = flag

        await self._each_shard(groups, ask, fail_quietly=True)
        return present

    async def get(self, layout_id: str, block_hashes: Sequence[bytes],
                  into: Sequence[memoryview] | None = None,
                  device: SlotDestination | None = None) -> list[BytesLike]:
        """The blocks' payloads, in order, every checksum verified; raises (BlockNotFound, DataPlaneError,
        StoreUnavailable) unless every block was served. `into`: one writable buffer per block (e.g. staging
        rows) that it is received into, uncopied; after an error they hold unverified bytes. `device` (with
        `into`; a worker on CUDA): blocks of same-host shared-memory shards may be copied straight to the
        device instead (their indexes in device.on_device; their `into` buffers are then left unwritten)."""
        if into is not None and len(into) != len(block_hashes):
            raise ValueError(f"{len(into)} buffers for {len(block_hashes)} blocks")
        if device is not None and into is None:
            raise ValueError("a get to the device needs into (the rows of the blocks that do not go there)")
        payloads: list[BytesLike | None] = [None] * len(block_hashes)
        groups = self._groups(block_hashes)
        if block_hashes and not groups:
            raise StoreUnavailable("no live kvcache shard")

        async def fetch(shard: Shard, indexes: list[int]) -> None:
            client, hashes = self._client(shard, "read"), [block_hashes[i] for i in indexes]
            buffers = None if into is None else [into[i] for i in indexes]
            blocks = await self._leased_get(shard, client, layout_id, hashes, buffers, device, indexes)
            if blocks is None:
                blocks = await client.get_blocks("", block_hashes=hashes, layout_id=layout_id, into=buffers)
            for i, block in zip(indexes, blocks, strict=True):
                payloads[i] = block

        await self._each_shard(groups, fetch, fail_quietly=False)
        return [p for p in payloads if p is not None]

    async def put(self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[BytesLike]) -> int:
        """Store blocks on their shards; the number of blocks sent. Raises on the first failed shard. Each
        shard's put runs on a writer thread (each socket operation bounded by timeout_s there) and is waited for
        even when this call is cancelled: the payloads are read until it returns."""
        groups = self._groups(block_hashes)
        if block_hashes and not groups:
            raise StoreUnavailable("no live kvcache shard")
        loop = asyncio.get_running_loop()

        async def send(shard: Shard, indexes: list[int]) -> None:
            putter = self._putters.get(shard.data_plane_address)
            if putter is None:
                putter = BlockingPutClient(shard.data_plane_address, self.secret, self.timeout_s)
                self._putters[shard.data_plane_address] = putter
            await loop.run_in_executor(self._put_threads, putter.put_blocks, layout_id,
                                       [block_hashes[i] for i in indexes], [payloads[i] for i in indexes])

        sends = asyncio.gather(*(send(shard, indexes) for shard, indexes in groups.items()), return_exceptions=True)
        try:
            results = await asyncio.shield(sends)
        except asyncio.CancelledError:
            await sends  # the threads still read the payloads: return only once they are done
            raise
        self._raise_first(list(groups), results, fail_quietly=False)
        return len(block_hashes)

    async def prepare_shared_memory(self, layout_id: str) -> int:
        """Map (and, on a GPU, register) the region of every live same-host shared-memory shard now, ahead of
        the first load (SharedMemoryReads.prepare); how many are registered. Failures are left to the loads."""
        shards = [s for s in self.shards.live().values() if self._same_host_shm(s)]
        results = await asyncio.gather(*(self.shared_memory.prepare(self._client(s, "read"), layout_id)
                                         for s in shards), return_exceptions=True)
        return sum(r is True for r in results)

    def _same_host_shm(self, shard: Shard) -> bool:
        """Whether gets from `shard` go through its shared memory (kv_transport and host identity, path_for)."""
        return self.reads_for(shard) is self.shared_memory

    def reads_for(self, shard: Shard) -> LeasedReads | None:
        """The leased-slot path a get from `shard` takes first (None: the data-plane get)."""
        path = path_for(self.transport, shard, self.shared_memory.host_id, not self._transfer_engine_error)
        if path == "shm":
            return self.shared_memory
        return self.transfer_engine if path == "transfer_engine" else None

    async def _leased_get(self, shard: Shard, client: DataPlaneClient, layout_id: str,
                          block_hashes: list[bytes], into: list[memoryview] | None,
                          device: SlotDestination | None = None,
                          indexes: list[int] | None = None) -> list[BytesLike] | None:
        """The blocks through a leased-slot path (shared memory, straight to the device when `device` is given;
        the transfer engine); None: not taken or failed, the data plane serves them."""
        reads = self.reads_for(shard)
        if reads is None:
            return None
        try:
            if reads is self.shared_memory:
                return await reads.get(client, layout_id, block_hashes, into, device, indexes)
            return await reads.get(client, layout_id, block_hashes, into)
        except DataPlaneConnectionError:
            raise  # the shard is gone: the data plane would fail too
        except TransferEngineUnavailable as exc:  # once: the library does not load in this process
            self._transfer_engine_error = str(exc)
            log.warning("kvcache gets take the data plane: %s", exc)
            return None
        except Exception as exc:  # refused, not held in slots, torn, a transfer error: the data plane serves them
            reads.num_fallbacks += 1
            log.debug("kvcache shard %s: %s get fell back to the data plane: %r", shard.name,
                      type(reads).__name__, exc)
            return None

    # -- internals ----------------------------------------------------------------------------------------------
    def _groups(self, block_hashes: Sequence[bytes]) -> dict[Shard, list[int]]:
        live = self.shards.live()
        return {live[name]: indexes for name, indexes in group_by_shard(block_hashes, live).items()}

    async def _each_shard(self, groups: dict[Shard, list[int]], work, *, fail_quietly: bool) -> None:
        """Run work(shard, indexes) for every shard concurrently, each bounded by timeout_s."""
        shards = list(groups)
        results = await asyncio.gather(
            *(asyncio.wait_for(work(shard, groups[shard]), self.timeout_s) for shard in shards),
            return_exceptions=True)
        self._raise_first(shards, results, fail_quietly=fail_quietly)

    def _raise_first(self, shards: list[Shard], results: list, *, fail_quietly: bool) -> None:
        """Forget the shards whose connection failed; raise the first error unless fail_quietly."""
        first_error: BaseException | None = None
        for shard, result in zip(shards, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if isinstance(result, (DataPlaneConnectionError, OSError)):
                self.shards.forget(shard.name)  # down: its blocks are misses until it heartbeats again
            if fail_quietly:
                log.debug("kvcache shard %s failed: %r", shard.name, result)
            elif first_error is None:
                first_error = result
        if first_error is not None:
            if isinstance(first_error, TimeoutError):
                raise StoreUnavailable(f"a kvcache shard took over {self.timeout_s:g} s") from first_error
            raise first_error

    def _client(self, shard: Shard, purpose: str) -> DataPlaneClient:
        key = (shard.data_plane_address, purpose)
        client = self._clients.get(key)
        if client is None:
            client = DataPlaneClient(shard.data_plane_address, self.secret, timeout_s=self.timeout_s)
            self._clients[key] = client
        return client

    async def _on_heartbeat(self, beat: KvStoreHeartbeat, msg) -> None:
        self.shards.observe(beat)
