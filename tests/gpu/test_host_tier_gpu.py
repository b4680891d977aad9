"""The host-memory KV tier on CUDA (copy stream, pinned slots, events): a prompt evicted from a small device pool
comes back from the host tier with the tokens of a recompute, sync and async scheduling; no device block is handed
out again while an offload still copies from it; its copies (the one-launch Triton block copies, in staging
chunks) move export_blocks' payload bytes exactly, both cache layouts, bf16 and fp32."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS = 16, 24, 256
P = [(13 * i + 7) % 370 + 3 for i in range(100)]  # 100 tokens: 6 full blocks to hit
FILLERS = [[(31 * i + 17 * j) % 370 + 3 for j in range(120)] for i in range(1, 6)]
OTHER = list(range(40, 60))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def engine(model_dir, host_blocks: int, async_scheduling: bool = False, dtype: str = "float32",
           device_blocks: int = DEVICE_BLOCKS):
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    probe = EngineArgs(model=str(model_dir), block_size=BLOCK_SIZE, dtype=dtype, max_model_len=128,
                       kv_cache_bytes=64 << 20, kv_host_cache_bytes=0, progress=False)
    per_block = EngineCore(probe).kv_plan.bytes_per_block
    return EngineCore(EngineArgs(
        model=str(model_dir), block_size=BLOCK_SIZE, dtype=dtype, max_model_len=128, progress=False,
        kv_cache_bytes=device_blocks * per_block, kv_host_cache_bytes=host_blocks * per_block,
        async_scheduling=async_scheduling))


def run(core, tokens=None):
    tokens = {} if tokens is None else tokens
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def guard_block_reuse(core) -> list[int]:
    """Fail if the pool hands out a device block an offload still copies from; the count of such checks."""
    pool, tier, checks = core.scheduler.block_pool, core.host_tier, []
    get_new_blocks = pool.get_new_blocks

    def checked(num_blocks):
        blocks = get_new_blocks(num_blocks)
        for block in blocks:
            assert not tier.holds_device_block(block.block_id), f"block {block.block_id} reused mid-copy"
        checks.append(len(blocks))
        return blocks

    pool.get_new_blocks = checked
    return checks


@pytest.fixture(scope="module")
def recomputed(model_dir):
    from deepinfer.sampling.params import SamplingParams

    core = engine(model_dir, host_blocks=0)
    assert core.host_tier is None
    core.add_request("p", P, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return run(core)["p"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_evicted_prompt_comes_back_from_the_host_tier_with_the_recomputed_tokens(
        model_dir, recomputed, async_scheduling):
    from deepinfer.engine.request import RequestStatus
    from deepinfer.hashing import hash_blocks
    from deepinfer.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core = engine(model_dir, HOST_BLOCKS, async_scheduling)
    assert core.host_tier.cuda and core.host_tier.host.is_pinned()
    checks = guard_block_reuse(core)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:6]
    core.add_request("p0", P, greedy)
    assert run(core)["p0"] == recomputed
    for i, filler in enumerate(FILLERS):
        core.add_request(f"f{i}", filler, greedy)
        run(core)
    assert all(core.scheduler.block_pool.get_cached_block(h) is None for h in hashes)  # evicted from the device
    assert core.host_tier.pool.num_leading_hits(hashes) == 6

    core.add_request("o", OTHER, greedy.clone(max_tokens=40))
    tokens = {}
    for out in core.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    core.add_request("p", P, greedy)
    assert core.scheduler.requests["p"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    first_p = None
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "p" and first_p is None:
                first_p = out
    assert tokens["p"] == recomputed
    assert (first_p.num_cached_tokens, first_p.num_host_cached_tokens) == (96, 96)
    assert len(tokens["o"]) == 40
    assert core.host_tier.stats.loaded_blocks == 6 and sum(checks) > 0
    assert not core.host_tier.busy
    assert core.scheduler.block_pool.num_free_blocks == DEVICE_BLOCKS - 1


def test_offloads_hold_their_device_blocks_until_the_copy_completed(model_dir):
    from deepinfer.sampling.params import SamplingParams

    core = engine(model_dir, HOST_BLOCKS)
    checks = guard_block_reuse(core)
    tier, pool = core.host_tier, core.scheduler.block_pool
    for i, filler in enumerate(FILLERS * 2):
        core.add_request(f"f{i}", filler, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while core.has_unfinished_requests():
            core.step()
            for copy in tier._offloads:  # in flight: each block referenced, so out of the free queue
                assert all(block.ref_cnt > 0 and block.prev_free is None for block in copy.blocks)
    assert sum(checks) > 0
    assert not tier.busy and pool.num_free_blocks == DEVICE_BLOCKS - 1


def test_bf16_a_host_load_gives_the_text_of_a_device_prefix_hit(model_dir):
    """In bfloat16 a prompt computed over 96 cached tokens need not give the text of its computation from scratch
    (other kernels, other rounding); it must give the text of a device prefix hit of those 96 tokens: the host tier
    brings back the very bytes."""
    from deepinfer.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def send(core, request_id):
        core.add_request(request_id, P, greedy)
        outputs = []
        while core.has_unfinished_requests():
            outputs += [out for out in core.step() if out.request_id == request_id]
        return [t for out in outputs for t in out.new_token_ids], outputs[0]

    roomy = engine(model_dir, 0, dtype="bfloat16", device_blocks=64)
    send(roomy, "first")
    hit, first_out = send(roomy, "hit")
    assert (first_out.num_cached_tokens, first_out.num_host_cached_tokens) == (96, 0)

    core = engine(model_dir, HOST_BLOCKS, dtype="bfloat16")
    send(core, "p0")
    for i, filler in enumerate(FILLERS):
        core.add_request(f"f{i}", filler, greedy)
        run(core)
    loaded, first_out = send(core, "p")
    assert (first_out.num_cached_tokens, first_out.num_host_cached_tokens) == (96, 96)
    assert loaded == hit


def random_bits(shape, dtype, generator):
    """A CUDA tensor of random bytes seen as dtype (NaN patterns included: the copies move bytes, not values)."""
    numel = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, device="cuda", generator=generator).view(dtype).view(
        shape)


def block_bytes(kv, block_id):
    """One block's bytes of a K/V [2, NB, ...] or latent [NB, ...] cache (a view)."""
    return (kv[:, block_id] if kv.dim() == 5 else kv[block_id]).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 64, 16, 2, 64), (64, 16, 576)], ids=["kv", "latent"])
def test_the_tier_copies_move_the_payload_bytes_through_the_triton_kernels(monkeypatch, shape, dtype):
    from deepinfer.engine import host_tier
    from deepinfer.engine.block_pool import BlockPool
    from deepinfer.engine.kv_transfer import block_nbytes, export_blocks, import_blocks
    from deepinfer.kernels import triton_block_copy

    generator = torch.Generator(device="cuda").manual_seed(0)
    kv_caches = [random_bits(shape, dtype, generator) for _ in range(4)]
    padding_block = [block_bytes(kv, 0).clone() for kv in kv_caches]
    monkeypatch.setattr(host_tier, "STAGING_BYTES", 7 * block_nbytes(kv_caches))  # chunks of 7 blocks
    tier = host_tier.HostTier(kv_caches, 48, BlockPool(64, enable_kv_events=False))
    assert tier.ops.gather_blocks is triton_block_copy.gather_blocks and tier._staging.shape[0] == 7
    # the warm-up copied block 0 (padding) to the staging and back
    assert all(torch.equal(block_bytes(kv, 0), before) for kv, before in zip(kv_caches, padding_block, strict=True))
    rng = random.Random(0)
    for n, slots in [(1, None), (7, None), (20, list(range(5, 25))), (40, None)]:  # 5..24: one run of slots
        slots = slots or rng.sample(range(48), n)
        block_ids = rng.sample(range(1, 64), n)
        tier.copy_to_host(block_ids, slots).synchronize()
        payloads = export_blocks(kv_caches, block_ids)
        assert [tier.host[s].numpy().tobytes() for s in slots] == payloads, n
        targets = rng.sample(range(1, 64), n)
        expected = [kv.clone() for kv in kv_caches]
        import_blocks(expected, targets, payloads)
        tier.copy_to_device(slots, targets).synchronize()
        assert all(torch.equal(kv.view(torch.uint8), want.view(torch.uint8))
                   for kv, want in zip(kv_caches, expected, strict=True)), n


def test_write_behind_reads_pinned_host_slots_holding_the_device_bytes(model_dir):
    """Write-behind's payloads on CUDA: views of the pinned slots (the batched offload's copies), equal to the device
    export of the same blocks, and left alone by later offloads until released."""
    from deepinfer.engine.kv_load import pin_cached
    from deepinfer.engine.kv_transfer import export_blocks
    from deepinfer.hashing import hash_blocks
    from deepinfer.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core = engine(model_dir, host_blocks=8)
    core.add_request("p0", P, greedy)
    run(core)  # going idle flushes the pending offload; the steps go on until its copy completed
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:6]
    pool = core.scheduler.block_pool
    expected = export_blocks(core.runner.kv_caches, [pool.get_cached_block(h).block_id for h in hashes])
    cached = pin_cached(core, hashes)
    assert cached.block_hashes == hashes and [bytes(p) for p in cached.payloads] == expected
    for i, filler in enumerate(FILLERS):  # 7 blocks each through the 2 slots left unpinned
        core.add_request(f"f{i}", filler, greedy)
        run(core)
    assert [core.host_tier.pool.lookup(h) for h in hashes] == cached.slots
    assert [bytes(p) for p in cached.payloads] == expected  # never rewritten while pinned
    slots = cached.slots
    cached.release()
    core.add_request("o", OTHER, greedy)
    run(core)  # its first step unpins them
    assert not any(core.host_tier.pool.is_pinned(slot) for slot in slots)
