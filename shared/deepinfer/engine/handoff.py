"""Disaggregated prefill → decode on top of an EngineCore: prefill leases and admission of pulled KV.

Prefill side: a request added with `hold_blocks=True` keeps its KV blocks referenced after it finishes (its
lease); `export_held` reads them for the data plane and the scheduler's `release_held` ends the lease. Decode side:
`admit_prefilled` allocates blocks for a prompt computed elsewhere, writes the pulled KV into them and joins
the running batch, so the next step decodes the prefill worker's first token. `Engine` is their front door.

All of these touch scheduler state and KV tensors: call them on the engine thread, between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepinfer.engine.core import EngineCore
from deepinfer.engine.kv_transfer import export_blocks, import_blocks
from deepinfer.engine.outputs import EngineStats
from deepinfer.engine.requests import EngineRequest


class LeaseNotHeld(KeyError):
    """The request holds no KV under a lease (never held, released, expired) or the block ids differ."""


def export_held(core: EngineCore, request_id: str, block_ids: Sequence[int]) -> list[bytes]:
    """The bytes of a held request's blocks, if `block_ids` are exactly (a subset of) what it holds."""
    held = core.scheduler.held_block_ids(request_id)
    if held is None:
        raise LeaseNotHeld(f"request {request_id!r} holds no KV (lease ended or never held)")
    if not set(block_ids) <= set(held):
        raise LeaseNotHeld(f"request {request_id!r} does not hold blocks {sorted(set(block_ids) - set(held))}")
    return export_blocks(core.runner.kv_caches, list(block_ids))


def admit_prefilled(core: EngineCore, request: EngineRequest, payloads: Sequence[bytes]) -> bool:
    """Join the running batch with the prompt's KV pulled from a prefill worker; False when no blocks are free.

    `payloads` hold the KV of every block covering the prompt, in token order; blocks this worker already
    has in its prefix cache are reused and their payloads skipped.
    """

    def fill(block_ids: list[int]) -> None:
        import_blocks(core.runner.kv_caches, block_ids, payloads[len(payloads) - len(block_ids) :])

    return admit_filled(core, request, len(payloads), fill)


def admit_filled(core: EngineCore, request: EngineRequest, num_kv_blocks: int,
                 fill: Callable[[list[int]], None]) -> bool:
    """Admit a prompt computed elsewhere: allocate its blocks (reusing local prefix hits), `fill` the others
    with its KV, join the running batch. False when no blocks are free; a failed fill aborts it and re-raises.

    `num_kv_blocks`: blocks the KV source covers (every block of the prompt, the last may be partial);
    `fill(block_ids)` writes the source's last len(block_ids) blocks into those local blocks.
    """
    prompt_token_ids = request.prompt_token_ids
    num_blocks = -(-len(prompt_token_ids) // core.args.block_size)
    if num_kv_blocks != num_blocks:
        raise ValueError(f"kv payloads: {num_kv_blocks} blocks for a prompt needing {num_blocks}")
    engine_request = core.new_request(request.request_id, prompt_token_ids, request.sampling_params,
                                      request.cache_salt, request.output_token_ids)
    to_fill = core.scheduler.add_prefilled_request(engine_request, len(prompt_token_ids))
    if to_fill is None:
        return False
    if to_fill:
        try:
            fill(to_fill)
        except Exception:
            core.abort_requests([request.request_id])
            raise
    core.scheduler.commit_prefilled(request.request_id)
    return True


def engine_stats(core: EngineCore) -> EngineStats:
    """Current load of the engine."""
    scheduler = core.scheduler
    return EngineStats(
        scheduler.num_running,
        scheduler.num_waiting + len(scheduler.loading),  # loading from the store or the host tier: waiting too
        scheduler.num_held,
        scheduler.block_pool.num_free_blocks,
        core.kv_plan.num_blocks - 1,
        scheduler.num_added,
    )
