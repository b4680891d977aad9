"""`Engine`: the one front door of the engine, for the workers and `LLM`.

    add_request(EngineRequest)  → Admission   where its KV comes from is a field of the request (requests.py)
    step()                      → outputs     schedule → execute → update (EngineCore)
    abort, stats, spec_decode_stats, take_kv_events, kv_snapshot, cached_prefix_tiers
    rates / kv_costs                                                 measured load and prefill rates (kv_rates)
    held_block_ids / export_held / release_held / device_export      a prefill worker's leases
    staging_pool / import_chunk / complete_load / fail_load / pin_cached  the kvcache store's loads and writes

Every method that changes scheduler state or touches KV tensors runs on the thread that steps the engine, between
steps; from another thread, send it as an `EngineCommand` (commands.py). Reads marked "any thread" are hints taken
without stopping the engine. `core` is the inside (scheduler, runner, host tier): tests and benches may reach in;
services and `deepinfer.worker` never do.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.block_pool import KvCacheEvent
from deepinfer.engine.core import EngineCore
from deepinfer.engine.drafter import Drafter
from deepinfer.engine.execution import ExecutionMode
from deepinfer.engine.handoff import admit_filled, admit_prefilled, engine_stats, export_held
from deepinfer.engine.host_tier import HostTierReport
from deepinfer.engine.kv_device_transfer import PeerCaches, copy_into, export_for_handles, host_id
from deepinfer.engine.kv_load import (
    CachedPayloads,
    complete_load,
    fail_load,
    import_chunk,
    new_staging_pool,
    pin_cached,
    start_load,
)
from deepinfer.engine.kv_transfer import DeviceRows, StagingChunk, StagingPool, block_nbytes, kv_layout_of
from deepinfer.engine.outputs import EngineOutput, EngineStats
from deepinfer.engine.requests import (
    Admission,
    ComputeKv,
    EngineRequest,
    LoadPlan,
    PeerDeviceKv,
    PulledKv,
    StoredKv,
)
from deepinfer.engine.slot_dma import copy_slots
from deepinfer.engine.spec_decode_stats import SpecDecodeStats
from deepinfer.engine.start_progress import StartProgress
from deepinfer.kv_costs import KvCosts
from deepinfer.kv_rates import MeasuredRates
from deepinfer.protocol.kv import KvDeviceExport, KvHandle, KvLayout
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    """One model's engine (module docstring): build it from `EngineArgs`, then add requests and step it."""

    def __init__(self, args: EngineArgs, progress: StartProgress | None = None) -> None:
        """Load and plan (seconds to minutes); `progress`, when given, hears each phase of that as it begins."""
        #: The inside: scheduler, runner, host tier (for tests and benches only).
        self.core = core = EngineCore(args, progress)
        self.args = args
        self.model_dir: Path = core.model_dir
        self.tokenizer: Tokenizer | None = core.tokenizer
        self.generation_config: dict = core.generation_config
        self.device: torch.device = core.device
        self.max_model_len: int = core.max_model_len
        #: The model's identity in block hashes (deepinfer.hashing.model_fingerprint).
        self.fingerprint: bytes = core.fingerprint
        self.block_size: int = args.block_size
        self.vocab_size: int = core.model_config.vocab_size
        #: KV blocks in the device pool (the padding block included).
        self.num_kv_blocks: int = core.kv_plan.num_blocks
        #: The layout of this engine's KV blocks: what a KvHandle from another engine must match.
        self.kv_layout: KvLayout = kv_layout_of(core.runner.kv_caches, args.block_size)
        #: Bytes of one KV block of every layer (a store payload, a host-tier slot).
        self.kv_bytes_per_block: int = block_nbytes(core.runner.kv_caches)
        #: Measured prefill and load rates (deepinfer.kv_rates): read from any thread as hints; the engine thread
        #: feeds prefill and the host tier's, the worker's event loop the store's (`observe_load`).
        self.rates: MeasuredRates = core.rates
        #: The execution mode the runner built (deepinfer.engine.execution).
        self.execution_mode: ExecutionMode = core.runner.mode
        #: Same-host owners' device caches mapped for PeerDeviceKv (CUDA IPC), each once.
        self._peers = PeerCaches(host_id())

    # -- requests (engine thread) ---------------------------------------------------------------------------------
    def check_request(self, request: EngineRequest) -> None:
        """ValueError (ContextLengthExceeded for length) when the request is invalid for this engine; queues
        nothing."""
        self.core.check_prompt(request.prompt_token_ids, request.sampling_params)

    def add_request(self, request: EngineRequest) -> Admission:
        """Admit a request, its prompt's KV from where `request.kv` says (requests.py); ValueError (naming what is
        wrong) for an invalid request, DeviceTransferError when a PeerDeviceKv export cannot be mapped here.
        A request asking for prompt_logprobs is computed here whatever its source: KV from elsewhere has no logits;
        so is every request of an engine with KV by layer type (enable_hybrid_kv_cache): KV from elsewhere comes in
        one table for every layer, not per group, yet."""
        if request.sampling_params.prompt_logprobs is not None or self.core.kv_groups:
            return self._compute(request)
        match request.kv:
            case ComputeKv():
                self._compute(request)
                return Admission("computed")
            case PulledKv(payloads=payloads):
                admitted = admit_prefilled(self.core, request, payloads)
                return Admission("pulled") if admitted else self._compute(request)
            case PeerDeviceKv(export=export, block_ids=block_ids):
                return self._admit_from_device(request, export, block_ids)
            case StoredKv(num_blocks=num_blocks, block_hashes=block_hashes):
                return self._admit_stored(request, num_blocks, block_hashes)
        raise TypeError(f"unknown KV source {request.kv!r}")

    def _compute(self, request: EngineRequest) -> Admission:
        self.core.add_request(request.request_id, request.prompt_token_ids, request.sampling_params,
                              request.cache_salt, output_token_ids=request.output_token_ids,
                              hold_blocks=request.hold_blocks)
        return Admission("computed")

    def _admit_from_device(self, request: EngineRequest, export: KvDeviceExport,
                           block_ids: Sequence[int]) -> Admission:
        src_caches = self._peers.get(export)
        copied: list[torch.cuda.Event] = []

        def fill(dst_block_ids: list[int]) -> None:
            copied.extend(copy_into(self.core.runner.kv_caches, src_caches, block_ids, dst_block_ids))

        if not admit_filled(self.core, request, len(block_ids), fill):
            return self._compute(request)
        return Admission("device", copied=copied[0] if copied else None)

    def _admit_stored(self, request: EngineRequest, num_blocks: int, block_hashes: Sequence[bytes]) -> Admission:
        """start_load, and the payloads of the plan's blocks the host tier holds (None for the others: from the
        store), read in the same call so no eviction falls in between."""
        plan = start_load(self.core, request, num_blocks)
        if plan is None:  # the device holds them, or no room: queued to compute
            return Admission("computed")
        planned = block_hashes[plan.first_block : plan.first_block + len(plan.block_ids)]
        host_tier = self.core.host_tier
        local = host_tier.payloads(planned) if host_tier is not None else [None] * len(planned)
        return Admission("loading", load=plan, local_payloads=local)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests now and drop every block reference they hold."""
        self.core.abort_requests(request_ids)

    def step(self) -> list[EngineOutput]:
        """One engine step: schedule → execute → update; each running request's new tokens."""
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        """True while a request is running, waiting or loading."""
        return self.core.has_unfinished_requests()

    @property
    def last_step_kind(self) -> str:
        """decode, mixed, prefill or empty: the kind of step the last `step()` spent its time on."""
        return self.core.last_step_kind

    def bind_thread(self) -> None:
        """Make the engine's device current on the calling thread (call once on the thread that steps it)."""
        self.core.bind_thread()

    def close(self) -> None:
        """Release what outlives the object: tensor-parallel worker processes (no-op otherwise)."""
        self.core.close()

    # -- load, events, counters ------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Current load (engine thread, or any thread as a hint)."""
        return engine_stats(self.core)

    @property
    def num_replayed_tokens(self) -> int:
        """KV by layer type: tokens prefix hits recomputed although the global layers had them cached (a hit needs
        the local layers' window before it: engine/hybrid_kv_manager.py); 0 without KV groups. Any thread, a hint."""
        return getattr(self.core.scheduler.kv_manager, "num_replayed_tokens", 0)

    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculative decoding's acceptance counters since start, a copy (all zero when it is off); any thread, as
        a hint (the engine thread only ever increases them)."""
        stats = self.core.spec_decode_stats
        return dataclasses.replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos))

    def install_drafter(self, drafter: Drafter | None, num_speculative_tokens: int | str | None = None) -> None:
        """Draft with `drafter` (one no speculative_config method names: a benchmark's oracle, a test's script)
        and optionally another draft length; None stops drafting. Engine thread, between steps; only on an engine
        built with a speculative_config (EngineCore.install_drafter)."""
        self.core.install_drafter(drafter, num_speculative_tokens)

    def take_kv_events(self) -> list[KvCacheEvent]:
        """Prefix-cache events of the device pool, then of the host tier, since the last call."""
        return self.core.take_kv_events()

    def kv_snapshot(self) -> tuple[list[bytes], list[bytes]]:
        """(every block hash in the device prefix cache, every block hash in the host tier)."""
        host_tier = self.core.host_tier
        host = host_tier.pool.block_hashes() if host_tier is not None else []
        cached = self.core.scheduler.block_pool.cached_block_hash_to_block
        if self.core.kv_groups:  # only group 0's hashes are the requests' own (others are group-tagged)
            return [h for h, block in cached.items() if not block.group], host
        return list(cached), host

    def cached_prefix_tiers(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks in the device prefix cache, the blocks after them held by the host tier), as admission
        reuses and loads them. Any thread, as a hint: a block evicted meanwhile only means a load or a recompute,
        never wrong KV (admission checks again)."""
        pool, host_tier = self.core.scheduler.block_pool, self.core.host_tier
        num_device = next((i for i, h in enumerate(block_hashes) if pool.get_cached_block(h) is None),
                          len(block_hashes))
        if host_tier is None:
            return num_device, 0
        return num_device, host_tier.pool.num_leading_hits(block_hashes[num_device:])

    def kv_costs(self, store_path: str | None) -> KvCosts:
        """Load or recompute at this engine's measured rates (deepinfer.kv_costs), its store loads taking
        `store_path` (kv_rates.STORE or STORE_SHM; None: no store). Any thread, as a hint."""
        return self.rates.costs(self.block_size, self.kv_bytes_per_block, host=self.has_host_tier,
                                store_path=store_path)

    @property
    def has_host_tier(self) -> bool:
        """True when the host-memory KV tier is on."""
        return self.core.host_tier is not None

    def host_tier_report(self) -> HostTierReport | None:
        """The host tier's counters and the samples since the last call (any thread); None when it is off."""
        host_tier = self.core.host_tier
        return host_tier.report() if host_tier is not None else None

    @property
    def num_graph_replays(self) -> int:
        """Steps that replayed a decode CUDA graph."""
        graphs = self.core.runner.graphs
        return graphs.num_replays if graphs is not None else 0

    @property
    def num_serving_compiles(self) -> int:
        """Triton compiles since the engine started (a step waited for each)."""
        return self.core.compiles.serving_compiles

    # -- leases: a prefill worker's held KV (engine thread) ------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int] | None:
        """Block ids held for a finished request (hold_blocks), in token order; None when nothing is held."""
        return self.core.scheduler.held_block_ids(request_id)

    def export_held(self, request_id: str, block_ids: Sequence[int]) -> list[bytes]:
        """The bytes of a held request's blocks; LeaseNotHeld unless `block_ids` are among those it holds."""
        return export_held(self.core, request_id, block_ids)

    def release_held(self, request_id: str) -> bool:
        """End a lease; False if nothing was held."""
        return self.core.scheduler.release_held(request_id)

    def device_export(self) -> KvDeviceExport | None:
        """This engine's KV cache exported for same-host CUDA IPC pulls (once, at start); None: data plane only."""
        return export_for_handles(self.core, self._peers.local_host_id)

    @property
    def takes_kv(self) -> bool:
        """False with KV by layer type (enable_hybrid_kv_cache): KV another worker or tier holds comes in one table
        for every layer, so this engine recomputes it (`add_request`) and a caller need not fetch it."""
        return not self.core.kv_groups

    def accepts_device_kv(self, handle: KvHandle) -> bool:
        """True when this handle's blocks may come as PeerDeviceKv (any thread, a hint: mapping may still fail)."""
        return self.takes_kv and self._peers.usable(handle, self.device)

    def close_peers(self) -> None:
        """Drop every mapped owner cache (the owners' memory stays theirs)."""
        self._peers.clear()

    # -- the kvcache store's loads and write-behind (engine thread) ------------------------------------------------
    def staging_pool(self) -> StagingPool:
        """A new pool of staging rows for store loads, pinned on CUDA (allocate once, at start)."""
        return new_staging_pool(self.core.runner.kv_caches)

    def import_chunk(self, plan: LoadPlan, first: int, rows: torch.Tensor, pool: StagingPool,
                     device: DeviceRows | None = None) -> tuple[bool, torch.cuda.Event | None]:
        """Write verified rows into the plan's blocks [first, first + len(rows)) (`device`: some of them are on the
        chunk's device side already); (False, None) when the request no longer loads or they do not fit, else
        (True, the event after which the rows may be reused)."""
        return import_chunk(self.core, plan, first, rows, pool, device)

    def copy_slots(self, pool: StagingPool, chunk: StagingChunk, src: torch.Tensor, slots: Sequence[int],
                   nbytes: int, positions: Sequence[int]) -> torch.cuda.Event:
        """CUDA: copy registered shared-memory slots into a staging chunk's device rows on the pool's copy stream
        (deepinfer.engine.slot_dma); the event after which they are there."""
        return copy_slots(pool, chunk, src, slots, nbytes, positions, self.core.runner.kv_caches[0].device)

    def complete_load(self, plan: LoadPlan, num_host_blocks: int = 0) -> bool:
        """Every chunk was imported: the blocks are cached and the request runs; False when it was aborted."""
        return complete_load(self.core, plan, num_host_blocks)

    def fail_load(self, request_id: str) -> None:
        """The load failed or timed out: the request's prompt is recomputed."""
        fail_load(self.core, request_id)

    def pin_cached(self, block_hashes: Sequence[bytes]) -> CachedPayloads:
        """The blocks still cached, for write-behind (host-tier slots pinned as views, or exported from the
        device); the caller calls `release()` when done reading."""
        return pin_cached(self.core, block_hashes)
