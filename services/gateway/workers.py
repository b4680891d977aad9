"""What the gateway knows of the workers, from their WorkerLoad heartbeats: who is alive, in which role, and the
model fingerprint (plus block size) that block hashes are computed with."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.bus import IncomingMsg
from deepinfer.kvcache.hashing import hash_blocks
from deepinfer.protocol import WorkerLoad, WorkerRole

logger = logging.getLogger(__name__)

#: Block size used until heartbeats say otherwise (WorkerLoad does not carry it yet; the workers' default).
DEFAULT_BLOCK_SIZE = 16

_PREFILL_ROLES = frozenset({WorkerRole.PREFILL, WorkerRole.BOTH})
_DECODE_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.BOTH})


@dataclass
class _Seen:
    load: WorkerLoad
    last_seen_s: float


class WorkerTable:
    """Workers seen in heartbeats; a worker is alive while its last heartbeat is younger than `lease_s`."""

    def __init__(
        self,
        lease_s: float = 3.0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_s = lease_s
        self.default_block_size = block_size
        self._clock = clock
        self._workers: dict[str, _Seen] = {}

    async def on_heartbeat(self, load: WorkerLoad, msg: IncomingMsg | None = None) -> None:
        """Bus handler for `heartbeat_all(model)`."""
        self.observe(load)

    def observe(self, load: WorkerLoad) -> None:
        """Record one heartbeat (kvcache shards are not workers of the model and are ignored)."""
        if load.role is WorkerRole.KVCACHE:
            return
        previous = self._workers.get(load.worker_id)
        if previous is None:
            logger.info("worker %s (%s) joined", load.worker_id, load.role.value)
        elif previous.load.model_fingerprint != load.model_fingerprint:
            logger.warning("worker %s changed its model fingerprint", load.worker_id)
        self._workers[load.worker_id] = _Seen(load, self._clock())
        self._prune()

    def is_alive(self, worker_id: str) -> bool | None:
        """True/False for a worker seen in heartbeats (lease held or lapsed); None for one never seen."""
        seen = self._workers.get(worker_id)
        if seen is None:
            return None
        return self._clock() - seen.last_seen_s <= self.lease_s

    def live_workers(self) -> list[WorkerLoad]:
        """Heartbeats of every worker whose lease holds."""
        now = self._clock()
        return [s.load for s in self._workers.values() if now - s.last_seen_s <= self.lease_s]

    def has_prefill(self) -> bool:
        """A live, non-draining worker can prefill (role prefill or both)."""
        return any(w.role in _PREFILL_ROLES and not w.draining for w in self.live_workers())

    def has_decode(self) -> bool:
        """A live, non-draining worker can decode (role decode or both)."""
        return any(w.role in _DECODE_ROLES and not w.draining for w in self.live_workers())

    def model_fingerprint(self) -> bytes | None:
        """The fingerprint the live workers advertise (the most recent heartbeat's), None before any."""
        live = sorted(self._workers.values(), key=lambda s: s.last_seen_s, reverse=True)
        now = self._clock()
        return next((s.load.model_fingerprint for s in live if now - s.last_seen_s <= self.lease_s), None)

    def block_size(self) -> int:
        """Tokens per KV block: from heartbeats when they carry it, else the configured default."""
        sizes = {getattr(w, "block_size", None) for w in self.live_workers()} - {None}
        return int(next(iter(sizes))) if len(sizes) == 1 else self.default_block_size

    def block_hashes(self, prompt_token_ids: list[int], cache_salt: str) -> tuple[list[bytes], bytes | None]:
        """(block hashes of the prompt's full blocks, the fingerprint used); no hashes before any heartbeat."""
        fingerprint = self.model_fingerprint()
        if fingerprint is None:
            return [], None
        return hash_blocks(prompt_token_ids, self.block_size(), fingerprint, cache_salt), fingerprint

    def _prune(self) -> None:
        # Forget workers silent for 10 leases: the table stays bounded as workers come and go.
        horizon = self._clock() - 10 * self.lease_s
        for worker_id in [w for w, s in self._workers.items() if s.last_seen_s < horizon]:
            del self._workers[worker_id]
