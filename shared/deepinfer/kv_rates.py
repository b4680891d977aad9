"""What one worker measured of its KV costs: how fast each lower tier loads (bytes/s) and how fast its engine
computes prompts (tokens/s), and what its load-or-recompute choices (deepinfer.kv_costs) decided. Pure (no torch).

    rate         fed by (each sample: amount, seconds)                                 prior (no sample yet)
    host         HostTier: a load's bytes, its copy's own time (CUDA timing events      HOST_PRIOR_BYTES_PER_S
                 on the copy stream; the CPU's synchronous copy)
    store        StoreTier: a load's bytes from the store, over the data plane, in      STORE_PRIOR_BYTES_PER_S
                 the whole load's time (gets and imports)
    store_shm    StoreTier: the same when every live shard is same-host shared memory   STORE_SHM_PRIOR_BYTES_PER_S
    prefill      EngineCore: a step's batched tokens, when it computed prompt tokens    PREFILL_PRIOR_TOKENS_PER_S
                 (steps of fewer than two blocks' tokens are not measured: their fixed cost dominates, as in
                 ChunkTimer)

Each rate is a throughput with exponential decay: amount and seconds are summed with every older sample's weight
times DECAY, and the rate is their ratio, so a large load counts more than a small one (whose fixed cost would
make the tier look slow) and the newest samples dominate. The first sample replaces the prior.

A tier judged slower than recomputing is not loaded from, so it gets no new sample: its rate stays as last
measured (a worker restart measures again). Threads: each rate is fed by one thread (host and prefill by the
engine thread, store by the event loop); any thread reads them as hints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.kv_costs import HOST, STORE, KvCosts

#: Host tier → device: the one-launch block copies measured on an H200 (41–48 GB/s; docs/journal/kvstore-2026-12.md,
#: "Host-tier copies against a pinned copy").
HOST_PRIOR_BYTES_PER_S = 40e9
#: A staged store load over the data plane (Python sockets, same host): ~1.4–1.5 GB/s (issue 31; docs/kvstore.md,
#: "Loading a prefix instead of recomputing it").
STORE_PRIOR_BYTES_PER_S = 1.5e9
#: A store get through a same-host shard's shared memory, checksums included: 5.7 GB/s on the CPU bench
#: (docs/journal/kvstore-2026-12.md, "Throughput (CPU only)").
STORE_SHM_PRIOR_BYTES_PER_S = 5.7e9
#: Prompt tokens per second by device type: an 8B model on an H200 in service (~17k tokens/s, docs/kvstore.md),
#: and the default model on one CPU core (~20 ms a token, deepinfer.engine.chunk_timer). Any other accelerator
#: takes the CUDA figure.
PREFILL_PRIOR_TOKENS_PER_S = {"cuda": 17_000.0, "cpu": 50.0}
#: Weight of everything older at each new sample.
DECAY = 0.5

#: The store's shared-memory path: a key of MeasuredRates.loads beside HOST and STORE.
STORE_SHM = "store_shm"


def prefill_prior(device_type: str) -> float:
    """The prefill prior (tokens/s) for a torch device type."""
    return PREFILL_PRIOR_TOKENS_PER_S.get(device_type, PREFILL_PRIOR_TOKENS_PER_S["cuda"])


@dataclass
class Throughput:
    """amount / seconds with exponentially decayed sums (module docstring); `prior` until the first sample."""

    prior: float
    #: (decayed amount, decayed seconds, samples taken): replaced whole at each sample, so a reader on another
    #: thread never mixes two samples' sums.
    sums: tuple[float, float, int] = (0.0, 0.0, 0)

    def observe(self, amount: float, seconds: float) -> None:
        """One sample: `amount` (bytes or tokens) in `seconds`; ignored unless both are positive."""
        if amount <= 0 or seconds <= 0:
            return
        total, total_s, num_samples = self.sums
        self.sums = (DECAY * total + amount, DECAY * total_s + seconds, num_samples + 1)

    @property
    def num_samples(self) -> int:
        """Samples taken so far."""
        return self.sums[2]

    @property
    def rate(self) -> float:
        """The measured rate, or the prior before any sample."""
        total, total_s, num_samples = self.sums
        return total / total_s if num_samples else self.prior


@dataclass
class MeasuredRates:
    """One worker's rates (module docstring) and its load-or-recompute decisions, in tokens by tier."""

    prefill: Throughput
    loads: dict[str, Throughput] = field(default_factory=lambda: {
        HOST: Throughput(HOST_PRIOR_BYTES_PER_S),
        STORE: Throughput(STORE_PRIOR_BYTES_PER_S),
        STORE_SHM: Throughput(STORE_SHM_PRIOR_BYTES_PER_S),
    })
    #: (tier, "loaded" | "recomputed") → prompt tokens the choices sent that way (plain ints; metrics read them).
    #: Host by the engine thread (HostTier's admission), store by the event loop (StoreTier's): one writer a key.
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    #: kv_load_choice "load": the costs load whatever a tier holds (KvCosts.always_load); rates still measured.
    always_load: bool = False

    @classmethod
    def for_device(cls, device_type: str, always_load: bool = False) -> MeasuredRates:
        """Priors for this device type."""
        return cls(Throughput(prefill_prior(device_type)), always_load=always_load)

    def observe_step(self, num_tokens: int, seconds: float, block_size: int) -> None:
        """A step that computed prompt tokens: `num_tokens` batched in `seconds` (short steps are not measured)."""
        if num_tokens >= 2 * block_size:
            self.prefill.observe(num_tokens, seconds)

    def observe_load(self, path: str, num_bytes: int, seconds: float) -> None:
        """A completed load of `num_bytes` from `path` (HOST, STORE or STORE_SHM) in `seconds`."""
        self.loads[path].observe(num_bytes, seconds)

    def costs(self, block_size: int, kv_bytes_per_block: int, *, host: bool, store_path: str | None) -> KvCosts:
        """The rule of deepinfer.kv_costs over these rates: `host` whether the worker has a host tier,
        `store_path` STORE or STORE_SHM (None: no store)."""
        return KvCosts(
            block_size=block_size,
            kv_bytes_per_block=kv_bytes_per_block,
            prefill_tokens_per_s=self.prefill.rate,
            host_bytes_per_s=self.loads[HOST].rate if host else None,
            store_bytes_per_s=self.loads[store_path].rate if store_path is not None else None,
            always_load=self.always_load,
        )

    def decided(self, tier: str, num_loaded_tokens: int, num_recomputed_tokens: int) -> None:
        """Count one choice's tokens of `tier`: loaded, and recomputed though `tier` held them."""
        for outcome, num_tokens in (("loaded", num_loaded_tokens), ("recomputed", num_recomputed_tokens)):
            if num_tokens > 0:
                key = (tier, outcome)
                self.decisions[key] = self.decisions.get(key, 0) + num_tokens
