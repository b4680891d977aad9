"""One settings class per service, env prefix `DEEPINFER_<SERVICE>_`, each carrying the CommonSettings.

Default ports (each overridable; 0 = pick a free port, for internal and data-plane ports only):

| service   | API  | internal (/health /ready /metrics) | data plane |
|-----------|------|------------------------------------|------------|
| gateway   | 8000 | 8001                               | -          |
| scheduler | -    | 8002                               | -          |
| prefill   | -    | 8003                               | 8103       |
| decode    | -    | 8004                               | 8104       |
| kvcache   | -    | 8005                               | 8105       |
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ByteSize, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from deepinfer import subjects
from deepinfer.config.common import CommonSettings, EnvSettings, default_id, settings_config
from deepinfer.cpus import default_gateway_processes
from deepinfer.defaults import (
    DEFAULT_ADMISSION_WINDOW_S,
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DIRECT_DECODE_MIN_FRACTION,
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_DTYPE,
    DEFAULT_ENABLE_PREFIX_CACHING,
    DEFAULT_EXECUTION_MODE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_GRAPH_SAMPLING,
    DEFAULT_KV_INDEX_MAX_ENTRIES,
    DEFAULT_KV_USAGE_WEIGHT,
    DEFAULT_LOAD_FORMAT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MIXED_STEP_DECODE_KERNEL,
    DEFAULT_STORE_DISK_BYTES,
    DEFAULT_STORE_FSYNC,
    DEFAULT_STORE_RAM_BYTES,
    DEFAULT_STORE_TTL_S,
    DEFAULT_TENSOR_PARALLEL_SIZE,
    DEFAULT_WORKER_LEASE_S,
)

MiB = 1024**2

#: A listening port; 0 lets the OS pick one (advertised in heartbeats once bound).
AnyPort = Annotated[int, Field(ge=0, le=65535)]


def _check_subject_id(value: str, info: Any) -> str:
    return subjects.check_id(value, info.field_name)


class ServiceSettings(EnvSettings):
    """Base of the per-service settings: the shared settings ride along as `common`."""

    service: ClassVar[str] = ""

    common: CommonSettings = Field(
        default_factory=CommonSettings, description="Shared settings (DEEPINFER_*), built from the environment."
    )
    internal_port: AnyPort = Field(0, description="Port of /health, /ready and /metrics (0 = any free port).")
    drain_grace_s: float = Field(
        DEFAULT_DRAIN_GRACE_S, gt=0, description="After SIGTERM: time to finish in-flight work; past it the service ends what is left "
        "(a gateway: an error to each open request) and exits within a few seconds more.",
    )
    gil_switch_interval_s: float = Field(
        0.0005, gt=0, le=0.1,
        description="Python's thread switch interval (sys.setswitchinterval): the longest a thread holding the GIL "
        "(the engine thread, a tokenizer thread) makes the event loop wait; Python's default 0.005 costs a worker "
        "7-14% of its tokens/s (docs/serving-path.md).",
    )


class GatewaySettings(ServiceSettings):
    """The OpenAI/Anthropic-compatible HTTP front door."""

    service: ClassVar[str] = "gateway"
    model_config = settings_config("DEEPINFER_GATEWAY_")

    host: str = Field("127.0.0.1", description="Interface the API listens on (0.0.0.0 in a pod).")
    port: int = Field(8000, ge=1, le=65535, description="API port.")
    internal_port: AnyPort = Field(8001, description="Port of /health, /ready and /metrics (0 = any free port).")
    reuse_port: bool = Field(
        False, description="Share the API port with other gateway processes (SO_REUSEPORT; the kernel spreads "
        "connections over them): one gateway process handles SSE for a few hundred streams at most.",
    )
    processes: int | None = Field(
        None, ge=1, le=64, description="Gateway processes behind the API port (SO_REUSEPORT), under a small parent "
        "that restarts them and serves the internal port for all; unset = one per 4 usable cores (the cgroup CPU "
        "limit, else the CPU affinity), 1 to 4. 1 = this process serves the API itself.",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted API keys, comma-separated or a JSON list; each a plain key or `sha256:<hex digest>`; "
        "empty (and no api_keys_file) = no auth.",
        repr=False,
        json_schema_extra={"secret": True},
    )
    api_keys_file: Path | None = Field(
        None, description="A file of accepted keys, one per line: `sha256:<hex digest of the key>` (so the file "
        "holds no key) or a plain key; `#` comments. Read at start, added to api_keys.",
    )
    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests each API key may start per minute (429 + Retry-After past it); "
        "unset = no limit.",
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Tokens (prompt + max_tokens) each API key may ask for per minute (429 past it); "
        "unset = no limit.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest a request may take end to end; then 504 (or a stream error event)."
    )
    route_timeout_s: float = Field(
        2.0, gt=0, description="Wait for a scheduler's routing answer (it takes ~1 ms) before answering 503."
    )
    prefill_timeout_s: float = Field(300.0, gt=0, description="Longest a prefill (prompt compute) may take.")
    decode_timeout_s: float = Field(
        30.0, gt=0, description="Wait for a decode worker to accept a request (it pulls the prompt's KV first)."
    )
    first_token_timeout_s: float = Field(
        120.0, gt=0, description="Silence allowed before the decode worker's first chunk (it may compute the prompt)."
    )
    stream_timeout_s: float = Field(
        5.0, gt=0, description="Silence allowed between two token chunks before the request fails (502)."
    )
    route_fallback: bool = Field(
        True, description="When no scheduler answers (none subscribed, or every route attempt timed out), route the "
        "request from this gateway's own view of worker heartbeats (least loaded, no prefix-cache credit; counted "
        "in deepinfer_gateway_fallback_routes_total). Off: such requests get a 503.",
    )
    poll_interval_s: float = Field(
        0.25, gt=0, description="How often a waiting request checks worker heartbeats, silence and the client."
    )
    retry_after_s: float = Field(
        1.0, ge=0, description="Retry-After of a 503 when the scheduler gives none."
    )
    worker_lease_s: float = Field(
        DEFAULT_WORKER_LEASE_S, gt=0, description="A worker is considered dead after this long without a heartbeat."
    )
    migration: bool = Field(
        True, description="Resume a request on another decode worker when its worker dies or goes silent mid-stream "
        "(prompt + the tokens already sent; the client sees one stream). Off: the stream ends with an error event.",
    )
    migration_budget: int = Field(
        3, ge=0, description="Most re-issues of one request (migrations and prefill retries) before the clean error.",
    )
    migration_wait_s: float = Field(
        30.0, gt=0, description="Longest a migrating request waits for a decode worker to take it (none free, the "
        "lost one restarting, NATS reconnecting), trying every retry_after_s; then the clean error.",
    )
    max_request_bytes: ByteSize = Field(
        ByteSize(16 * MiB), ge=1, description="Largest accepted request body (e.g. 16MiB)."
    )
    max_prompt_chars: int | None = Field(
        None, ge=1, description="Longest prompt text (characters, after the chat template) that is tokenized: a "
        "longer one is a 400 (context_length_exceeded) before any tokenization. Unset = the context length times "
        "the tokenizer's longest token (a longer text cannot fit the context).",
    )
    sampling_defaults: Literal["model", "openai"] = Field(
        "model", description="Sampling fields a request leaves out: model = the model's recommended ones "
        "(generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty, else the model registry's, "
        "e.g. SmolLM2's temperature 0.2, top_p 0.9; vLLM's --generation-config auto, SGLang's --sampling-defaults "
        "model); openai = OpenAI's (temperature 1, top_p 1). A request's own values always win.",
    )
    trust_request_chat_template: bool = Field(
        False, description="Render chat templates sent in requests (`chat_template`, `chat_template_kwargs."
        "chat_template`); off: such a request is a 400 (a template is code the gateway runs, as vLLM's "
        "--trust-request-chat-template).",
    )
    gateway_id: str = Field(
        default_factory=partial(default_id, "gateway"), description="This gateway's id in subjects (a-z0-9_-)."
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [key.strip() for key in text.split(",") if key.strip()]
        return value

    _gateway_id = field_validator("gateway_id")(_check_subject_id)

    def resolved_processes(self) -> int:
        """`processes`, or the default for this machine's usable cores when unset."""
        return self.processes if self.processes is not None else default_gateway_processes()


class SchedulerSettings(ServiceSettings):
    """The router: KV index, worker membership, admission."""

    service: ClassVar[str] = "scheduler"
    model_config = settings_config("DEEPINFER_SCHEDULER_")

    internal_port: AnyPort = Field(8002, description="Port of /health, /ready and /metrics (0 = any free port).")
    scheduler_id: str = Field(
        default_factory=partial(default_id, "scheduler"), description="This replica's id (a-z0-9_-)."
    )
    worker_lease_s: float = Field(
        DEFAULT_WORKER_LEASE_S, gt=0, description="A worker is dropped after this long without a heartbeat."
    )
    routing_policy: Literal["prefix", "least_loaded", "round_robin"] = Field(
        "prefix", description="prefix: cached-prefix credit against load; least_loaded; round_robin (a baseline)."
    )
    kv_index_max_entries: int = Field(
        DEFAULT_KV_INDEX_MAX_ENTRIES, ge=1,
        description="Most (worker, block) entries in the KV index (~250 B each); past it the worker with the most "
        "entries loses its least recently stored or credited block.",
    )
    load_weight: float = Field(
        DEFAULT_LOAD_WEIGHT, ge=0,
        description="Cost of each request running, waiting or in flight on a worker, as a fraction of the routed "
        "prompt's tokens.",
    )
    kv_usage_weight: float = Field(
        DEFAULT_KV_USAGE_WEIGHT, ge=0,
        description="Cost of a worker's full KV pool (scaled by the fraction in use), as a fraction of the routed "
        "prompt's tokens.",
    )
    direct_decode_min_fraction: float = Field(
        DEFAULT_DIRECT_DECODE_MIN_FRACTION, ge=0, le=1, description="Skip the separate prefill when the decode worker already holds this fraction "
        "of the prompt's blocks.",
    )
    snapshot_timeout_s: float = Field(2.0, gt=0, description="Wait for one KV snapshot page before trying again.")
    warm_up_s: float = Field(
        1.2, ge=0, description="At start, listen to heartbeats and page KV snapshots this long (a worker heartbeat "
        "round) before taking route requests, so a restarted replica never routes blind.",
    )
    admission_queue_size: int = Field(
        1024, ge=0, description="Route requests that may wait for a decode worker with room (then overloaded)."
    )
    admission_wait_s: float = Field(
        1.0, ge=0, description="Longest a route request waits for room before the answer is overloaded (503); "
        "keep it below the gateway's route_timeout_s. 0 = never wait.",
    )

    _scheduler_id = field_validator("scheduler_id")(_check_subject_id)


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"block_size must be a power of two, got {value}")
    return value


class WorkerSettings(ServiceSettings):
    """Engine settings shared by prefill and decode workers."""

    worker_id: str = Field(default_factory=partial(default_id, "worker"), description="This worker's id (a-z0-9_-).")
    data_plane_host: str = Field(
        "127.0.0.1", description="Interface the KV data plane binds and advertises (the pod IP in Kubernetes)."
    )
    data_plane_port: AnyPort = Field(0, description="KV data-plane port (0 = any free port).")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between WorkerLoad heartbeats.")
    device: str = Field(DEFAULT_DEVICE, description="torch device, e.g. cuda:0, npu:0, cpu; auto = the best available.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        DEFAULT_DTYPE, description="Weights and KV dtype; auto = bfloat16 on a device and on a CPU with bf16 "
        "instructions (avx512_bf16, amx_bf16), else float32 (docs/cpu.md).",
    )
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, le=1024, description="Tokens per KV block (a power of two).")
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1, description="Most tokens computed in one step (chunked prefill)."
    )
    max_model_len: int | None = Field(None, ge=1, description="Context length limit; unset = the model's.")
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION, gt=0.0, le=1.0, description="Fraction of device memory this worker may use (weights + KV)."
    )
    kv_cache_bytes: ByteSize | None = Field(
        None, ge=1, description="KV cache budget in bytes (e.g. 2GiB); overrides gpu_memory_utilization, used on CPU."
    )
    kv_host_cache_bytes: ByteSize | None = Field(
        None, ge=0, description="Host-memory KV tier (pinned; docs/kvstore.md, Workers), e.g. 8GiB: cached blocks "
        "are copied there as they are computed and loaded back instead of recomputed. Unset = 8 GiB on one CUDA "
        "device (at most a quarter of the host memory), off on the CPU and with tensor parallelism; 0 = off.",
    )
    kv_load_choice: Literal["measured", "load"] = Field(
        "measured", description="A prompt's prefix held in the host tier or the store: measured = loaded only as far "
        "as loading beats recomputing it at this worker's measured rates (docs/kvstore.md, 'Load or recompute'); "
        "load = always loaded (to measure a load path, e.g. bench/kv/kv_tiers.py's forced modes).",
    )
    enable_prefix_caching: bool = Field(DEFAULT_ENABLE_PREFIX_CACHING, description="Reuse KV blocks of identical prefixes.")
    async_scheduling: bool | None = Field(
        None, description="Prepare step N+1 on the CPU while the device runs step N (see docs/gpu.md); unset = on "
        "for one CUDA device, off on the CPU and with tensor parallelism.",
    )
    prefill_chunk_s: float | None = Field(
        None, ge=0, description="Seconds of compute the prompt tokens of one engine step aim at (measured seconds "
        "per token), so an abandoned prompt frees the worker and a new request starts within about that long; "
        "unset = 0.5 on the CPU, off on accelerators (the token budget alone); 0 = off.",
    )
    engine_step_deadline_s: float = Field(
        120.0, gt=0,
        description="A single engine step running longer than this (a hung device or collective) makes /health "
        "answer 503, so the supervisor or the kubelet restarts the worker; first steps compile kernels: keep it "
        "well above them.",
    )
    load_format: Literal["auto", "dummy"] = Field(
        DEFAULT_LOAD_FORMAT,
        description="auto: the checkpoint's weights; dummy: random weights from config.json alone (vLLM's name), "
        "the same on every worker, for benchmarks without weight files.",
    )
    batch_invariant: bool = Field(
        DEFAULT_BATCH_INVARIANT, description="Same tokens and logprobs for a request whatever the batch (slower; docs/gpu.md)."
    )
    execution_mode: Literal["eager", "decode", "piecewise", "full"] = Field(
        DEFAULT_EXECUTION_MODE, description="Which steps replay CUDA graphs (docs/gpu.md): eager = none; decode = decode-only "
        "steps; piecewise = also prefill and mixed steps of Llama-family models, all but attention captured per "
        "token bucket; full = those steps as one graph per token bucket with attention inside. Eager on the CPU "
        "and with tensor parallelism, decode at most with batch_invariant.",
    )
    mixed_step_decode_kernel: bool = Field(
        DEFAULT_MIXED_STEP_DECODE_KERNEL, description="In a mixed prefill+decode step, attend the single-row sequences with the split-K decode "
        "kernel and only the prompts with the prefill kernel (off: the prefill kernel takes every row; docs/gpu.md).",
    )
    graph_sampling: bool = Field(
        DEFAULT_GRAPH_SAMPLING, description="Every CUDA graph that ends a step (decode graphs, full graphs of prompt steps) also "
        "computes the logits and each row's greedy token: an all-greedy step without penalties, bias or top "
        "logprobs launches no sampler (docs/gpu.md).",
    )
    admission_window_s: float = Field(
        DEFAULT_ADMISSION_WINDOW_S, ge=0, le=1, description="New requests that arrive in a burst while others run wait until the burst "
        "is over (no arrival for a quarter of this) or this long, and join the batch in one step: fewer mixed "
        "steps in running streams (0 = admit at the next step; docs/configuration.md).",
    )
    eager_step_switch_interval_s: float | None = Field(
        None, gt=0, le=0.1, description="Python's switch interval while a prefill or mixed step launches its "
        "layers (attention runs eagerly there, and each Triton launch lets the event loop take the GIL until the "
        "interval forces it back); unset: gil_switch_interval_s throughout (docs/serving-path.md).",
    )
    tensor_parallel_size: int = Field(
        DEFAULT_TENSOR_PARALLEL_SIZE, ge=1, description="Devices one worker shards every layer over (one process each; CUDA graphs off if > 1)."
    )
    kv_store: bool = Field(
        True, description="Use the kvcache store (docs/kvstore.md, Workers): load stored prefixes instead of "
        "recomputing them, write full blocks behind. Off, or with no live shard, the worker never touches it.",
    )
    kv_store_lookup_timeout_s: float = Field(
        0.5, gt=0, description="Longest the store's has-lookup before admission may take (then: recompute)."
    )
    kv_store_min_lookup_tokens: int = Field(
        256, ge=0, description="Ask the store at admission only when the prompt's blocks past those the device or "
        "host tier holds cover at least this many tokens; a shorter rest is recomputed, cheaper than the round "
        "trip and the load (as LMCache's 256-token chunks). 0: ask for every full block.",
    )
    kv_store_load_timeout_s: float = Field(
        10.0, gt=0, description="Longest a load of stored blocks may take; the request then recomputes them."
    )
    kv_store_write_queue_blocks: int = Field(
        4096, ge=1, description="Full blocks waiting to be written behind; past this new ones are dropped (counted)."
    )
    kv_store_write_batch_blocks: int = Field(
        64, ge=1, description="Blocks exported and put to the store per write-behind round."
    )
    kv_store_write_generated: bool = Field(
        False, description="Also write behind the blocks of generated tokens, not only prompt blocks (LMCache's "
        "save_decode_cache). With the host tier on they are sent from its pinned slots (no copy on the engine "
        "thread); without it each write-behind round gathers its blocks from the device on the engine thread.",
    )
    kv_store_shard_lease_s: float = Field(
        3.0, gt=0, description="A store shard is dropped after this long without a KvStoreHeartbeat."
    )
    kv_store_shm_dma: bool = Field(
        True, description="On CUDA, copy a same-host shard's shared-memory slots straight to the device (its region "
        "registered with cudaHostRegister, read-only); off, or where registration fails: copied on the CPU into "
        "pinned staging first (docs/kvstore.md, 'Same host: the shared-memory RAM tier').",
    )
    kv_store_shm_verify_checksums: bool = Field(
        False, description="Also verify each block's xxh3-64 on the shared-memory DMA path (a CPU read of every "
        "byte the copy moves: about as long as the copy). Off: the lease and the seqlock still catch a rewritten "
        "or evicted block; the checksum guards a RAM tier corrupted in place. The CPU path always verifies.",
    )
    kv_transport: Literal["auto", "dataplane", "mooncake"] = Field(
        "auto", description="How store gets (and a decode worker's pulls of a prefill worker's KV) move their bytes: "
        "auto = a same-host shard's shared memory, a shard (or prefill worker) on another host through Mooncake "
        "Transfer Engine when it serves one and the library loads here, else the data plane; dataplane = always the "
        "data plane; mooncake = the transfer engine for every peer that serves one, this host's too (docs/kvstore.md, "
        "\"Worker settings\"; docs/dataplane.md, \"P/D handoff through the same transport\"). Any failure: the "
        "data plane.",
    )

    _worker_id = field_validator("worker_id")(_check_subject_id)
    _block_size = field_validator("block_size")(_power_of_two)


def _parsed_json(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None


class PrefillSettings(WorkerSettings):
    """A prefill worker: prompt compute, KV handed off under a lease."""

    service: ClassVar[str] = "prefill"
    model_config = settings_config("DEEPINFER_PREFILL_")

    worker_id: str = Field(default_factory=partial(default_id, "prefill"), description="This worker's id (a-z0-9_-).")
    internal_port: AnyPort = Field(8003, description="Port of /health, /ready and /metrics (0 = any free port).")
    data_plane_port: AnyPort = Field(8103, description="KV data-plane port (0 = any free port).")
    kv_lease_s: float = Field(
        30.0, gt=0, description="How long handed-off KV stays pinned waiting for the decode worker's pull."
    )
    transfer_engine: bool = Field(
        False, description="Lease handed-off KV to decode workers' Mooncake Transfer Engines (this worker's engine "
        "named data_plane_host, over TCP): a decode worker whose kv_transport takes it reads the blocks with one "
        "batch instead of the data-plane get. Needs the `transfer-engine` extra and libibverbs1; any process that "
        "reaches the engine's ports can read the blocks being handed off (docs/dataplane.md, \"P/D handoff through "
        "the same transport\").",
    )
    transfer_engine_export_bytes: ByteSize = Field(
        ByteSize(1 << 30), ge=1, description="With transfer_engine: host memory of the blocks leased to transfer "
        "engines at once (mapped and registered whole at start, its pages touched as leases fill them); a lease "
        "that does not fit takes the data plane.",
    )


class DecodeSettings(WorkerSettings):
    """A decode worker: the running batch and token generation."""

    service: ClassVar[str] = "decode"
    model_config = settings_config("DEEPINFER_DECODE_")

    worker_id: str = Field(default_factory=partial(default_id, "decode"), description="This worker's id (a-z0-9_-).")
    internal_port: AnyPort = Field(8004, description="Port of /health, /ready and /metrics (0 = any free port).")
    data_plane_port: AnyPort = Field(8104, description="KV data-plane port (0 = any free port).")
    kv_pull_timeout_s: float = Field(
        30.0, gt=0, description="Longest a pull of a prompt's KV may take before the prompt is recomputed here."
    )
    speculative_config: str | None = Field(
        None, description="Speculative decoding as vLLM's speculative_config, a JSON object (docs/speculative.md), "
        'e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} '
        '(num_speculative_tokens "auto": draft lengths chosen per step from acceptance and measured step costs), '
        'or {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4} (a smaller checkpoint '
        "with the target's tokenizer, loaded beside it); "
        "checked when the engine is built (a bad one stops the start). Unset = off. With async scheduling, steps "
        "that verify drafts run synchronously between asynchronous ones.",
    )
    enable_hybrid_kv_cache: bool = Field(
        False, description="KV by layer type for sliding-window models (Gemma 3; docs/models.md): local layers' "
        "blocks freed as the window moves, prefix hits replayed from a window checkpoint. For now eager steps and "
        "no host tier; KV handed over by a prefill worker or loaded from the store is recomputed here (run it with "
        "no prefill worker: `deepinfer up --prefill 0`).",
    )
    hybrid_checkpoint_tokens: int = Field(
        1024, ge=1, description="With enable_hybrid_kv_cache: the local layers' window before every multiple of this "
        "many tokens is evicted last, so a prefix hit replays at most about this many tokens (a multiple of "
        "block_size).",
    )

    @field_validator("speculative_config")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        if value is not None and not isinstance(_parsed_json(value), dict):
            raise ValueError("must be a JSON object")
        return value


class KvCacheSettings(ServiceSettings):
    """One shard of the content-addressed KV store (RAM, then disk; docs/kvstore.md)."""

    service: ClassVar[str] = "kvcache"
    model_config = settings_config("DEEPINFER_KVCACHE_")

    shard: str = Field("0", description="This shard's name (a-z0-9_-); stable across restarts.")
    internal_port: AnyPort = Field(8005, description="Port of /health, /ready and /metrics (0 = any free port).")
    data_plane_host: str = Field(
        "127.0.0.1", description="Interface the data plane binds and advertises (the pod IP in Kubernetes)."
    )
    data_plane_port: AnyPort = Field(8105, description="Data-plane port (0 = any free port).")
    ram_bytes: ByteSize = Field(
        ByteSize(DEFAULT_STORE_RAM_BYTES), ge=0, description="RAM tier capacity (e.g. 4GiB)."
    )
    disk_dir: Path | None = Field(None, description="Disk tier directory; unset = <data_dir>/kvcache/<shard>.")
    disk_bytes: ByteSize = Field(ByteSize(DEFAULT_STORE_DISK_BYTES), ge=1, description="Disk tier capacity (live block bytes).")
    ttl_s: float = Field(DEFAULT_STORE_TTL_S, gt=0, description="A block expires this long after its last use.")
    fsync: Literal["none", "batch", "always"] = Field(
        DEFAULT_STORE_FSYNC, description="none: an OS crash may lose ~30 s of puts (kill -9 loses nothing); batch: nothing a "
        "put was acknowledged for; always: at most one block (docs/kvstore.md).",
    )
    shm_ram: bool = Field(
        False, description="Keep the RAM tier in shared memory (a file in shm_dir) that workers on this host read "
        "without the data-plane socket (docs/kvstore.md). Needs ram_bytes of room on that tmpfs.",
    )
    shm_dir: Path = Field(Path("/dev/shm"), description="The tmpfs directory of the shared-memory RAM tier.")
    shm_slot_bytes: ByteSize = Field(
        ByteSize(2 << 20), ge=4096, description="One shared-memory slot; a larger block is kept on disk only.",
    )
    transfer_engine: bool = Field(
        False, description="Serve the shared-memory RAM tier (needs shm_ram) to workers on other hosts through "
        "Mooncake Transfer Engine, named data_plane_host; the `transfer-engine` extra and libibverbs1 "
        "(docs/dataplane.md, \"Transfer engine\": any process that reaches its ports can read the tier).",
    )
    transfer_engine_protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="The transfer engine's transport: tcp, or rdma where the hosts have RDMA NICs."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between KvStoreHeartbeat messages.")
    maintenance_interval_s: float = Field(
        2.0, gt=0, description="Seconds between expiry sweeps, compaction steps and event publishes."
    )

    @model_validator(mode="after")
    def _transfer_engine_needs_shm(self) -> KvCacheSettings:
        if self.transfer_engine and not self.shm_ram:
            raise ValueError("transfer_engine serves the shared-memory RAM tier: it needs shm_ram")
        return self

    @field_validator("shard")
    @classmethod
    def _safe_shard(cls, value: str) -> str:
        subjects.kvcache_events(value)  # raises ValueError on an unsafe or reserved shard name
        return value

    @field_validator("disk_dir")
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    def resolved_disk_dir(self) -> Path:
        """The disk tier's directory: disk_dir, else <data_dir>/kvcache/<shard>."""
        return self.disk_dir or self.common.data_dir / "kvcache" / self.shard


#: Service name -> its settings class (the order `deepinfer config` prints them in).
SERVICE_SETTINGS: dict[str, type[ServiceSettings]] = {
    cls.service: cls
    for cls in (GatewaySettings, SchedulerSettings, PrefillSettings, DecodeSettings, KvCacheSettings)
}
