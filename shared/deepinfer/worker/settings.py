"""Worker settings → EngineArgs (the one place the two vocabularies meet)."""

from __future__ import annotations

import json
import operator
import os
import random
import secrets
from typing import Any

from deepinfer.config import DecodeSettings, WorkerSettings
from deepinfer.defaults import DEFAULT_CPU_PREFILL_CHUNK_S
from deepinfer.engine import EngineArgs
from deepinfer.protocol import WireSamplingParams
from deepinfer.sampling.params import SamplingParams


def engine_args(settings: WorkerSettings) -> EngineArgs:
    """EngineArgs of a worker: its model, device and cache knobs; KV events on (the scheduler indexes them)."""
    common = settings.common
    return EngineArgs(
        model=common.model,
        dtype=settings.dtype,
        device=settings.device,
        accelerator=common.accelerator,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_bytes=int(settings.kv_cache_bytes) if settings.kv_cache_bytes is not None else None,
        kv_host_cache_bytes=None if settings.kv_host_cache_bytes is None else int(settings.kv_host_cache_bytes),
        kv_load_choice=settings.kv_load_choice,
        enable_prefix_caching=settings.enable_prefix_caching,
        async_scheduling=settings.async_scheduling,
        prefill_chunk_s=worker_prefill_chunk_s(settings),
        batch_invariant=settings.batch_invariant,
        execution_mode=settings.execution_mode,
        mixed_step_decode_kernel=settings.mixed_step_decode_kernel,
        graph_sampling=settings.graph_sampling,
        admission_window_s=settings.admission_window_s,
        eager_step_switch_interval_s=settings.eager_step_switch_interval_s,
        load_format=settings.load_format,
        tensor_parallel_size=settings.tensor_parallel_size,
        enable_kv_events=True,
        model_revision=common.model_revision,
        model_cache_dir=common.model_cache_dir,
        progress=False,
        speculative_config=speculative_config(settings),
        **hybrid_kv_cache(settings),
    )


def hybrid_kv_cache(settings: WorkerSettings) -> dict[str, Any]:
    """A decode worker's KV-by-layer-type settings as EngineArgs fields (a prefill worker hands its KV over in one
    table for every layer: never)."""
    if not isinstance(settings, DecodeSettings) or not settings.enable_hybrid_kv_cache:
        return {}
    return {"enable_hybrid_kv_cache": True, "hybrid_checkpoint_tokens": settings.hybrid_checkpoint_tokens}


def speculative_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """A decode worker's speculative_config (its JSON setting, parsed; EngineArgs validates it). A prefill worker
    computes one token per request and never drafts: None."""
    if not isinstance(settings, DecodeSettings) or settings.speculative_config is None:
        return None
    return json.loads(settings.speculative_config)


def worker_prefill_chunk_s(settings: WorkerSettings) -> float:
    """The worker's prefill_chunk_s: its setting, else DEFAULT_CPU_PREFILL_CHUNK_S on the CPU and 0 (off) on an
    accelerator, where a step of the whole token budget takes milliseconds."""
    if settings.prefill_chunk_s is not None:
        return settings.prefill_chunk_s
    device = EngineArgs(device=settings.device).resolve_device()
    return DEFAULT_CPU_PREFILL_CHUNK_S if device.type == "cpu" else 0.0


#: Seeds of requests that set none. A generator seeded once from the OS, not `secrets` per request: that is a
#: getrandom syscall, and a syscall releases the GIL, which a busy worker's other thread then holds for up to the
#: switch interval. Reseeded in a forked child, so two processes never draw the same seeds.
_seeds = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _seeds.seed(secrets.randbits(128)))


#: Wire fields that key the validated-params cache (every field but those that vary per request or are lists).
_KEY_FIELDS = tuple(name for name in WireSamplingParams.model_fields
                    if name not in ("v", "seed", "stop", "stop_token_ids", "logit_bias"))
_key_of = operator.itemgetter(*_KEY_FIELDS)
#: Engine params already validated, by their key fields (seed None, no stop, stop_token_ids or logit_bias).
_validated: dict[tuple[Any, ...], SamplingParams] = {}
#: Distinct params kept validated (more: the cache starts again).
MAX_VALIDATED_PARAMS = 1024


def engine_sampling(wire: WireSamplingParams) -> SamplingParams:
    """The engine's SamplingParams from the wire message (same field names, validated again here), with a seed
    drawn here when the request set none: the engine would otherwise draw it and clone (and validate again) the
    params on its thread, in series with the device, once per admitted request.

    Requests of one deployment mostly ask for the same few params: those without a seed, stop strings, stop
    tokens or logit bias are validated once (the engine's checks are ~5 µs of the event loop a request) and then
    copied with a fresh seed and fresh lists. Any other request is built and validated as it comes."""
    fields = wire.__dict__
    if fields["seed"] is None and not fields["stop"] and not fields["stop_token_ids"] and fields["logit_bias"] is None:
        try:
            key = _key_of(fields)
            validated = _validated.get(key)
        except TypeError:  # an unhashable value: build it as it comes
            validated = key = None
        if validated is None:
            validated = SamplingParams(**{name: value for name, value in fields.items() if name != "v"})
            if key is not None:
                if len(_validated) >= MAX_VALIDATED_PARAMS:
                    _validated.clear()
                _validated[key] = validated
        params = object.__new__(SamplingParams)
        params.__dict__.update(validated.__dict__)
        params.stop, params.stop_token_ids, params.seed = [], [], _seeds.getrandbits(63)
        return params
    fields = wire.model_dump(exclude={"v"})
    if fields.get("seed") is None:
        fields["seed"] = _seeds.getrandbits(63)
    return SamplingParams(**fields)
