"""KV by layer type through the whole engine (EngineArgs.enable_hybrid_kv_cache): a tiny random Gemma 3 (five local
layers of window 8, one global) gives transformers' greedy tokens with per-group block tables, frees its local
blocks as the window moves, and serves prefix hits with a bounded replay; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.hybrid_kv_manager import HybridKVCacheManager
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.testing.paged_cache import random_prompt as prompt
from tests.unit.test_gemma3 import BLOCK_SIZE, NEW_TOKENS, WINDOW, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3-hybrid"), "gemma3", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def hybrid_llm(tiny_dir, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK_SIZE, "progress": False, "enable_hybrid_kv_cache": True,
              "hybrid_checkpoint_tokens": 16, **kwargs}
    return LLM(str(tiny_dir), **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_groups_pages_and_shared_caches(tiny_dir):
    llm = hybrid_llm(tiny_dir, kv_cache_bytes=1 << 20)
    core = llm.engine.core
    assert [g.layers for g in core.kv_groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert isinstance(core.scheduler.kv_manager, HybridKVCacheManager)
    caches = core.runner.kv_caches
    assert all(cache is caches[0] for cache in caches)  # groups of one layer: one buffer for all six layers
    plain = LLM(str(tiny_dir), block_size=BLOCK_SIZE, progress=False, kv_cache_bytes=1 << 20).engine.core
    # The same bytes hold six times the pages: a page is one layer's block, not six layers'.
    assert core.kv_plan.bytes_per_block * 6 == plain.kv_plan.bytes_per_block
    assert core.kv_plan.num_blocks == (1 << 20) // core.kv_plan.bytes_per_block


def test_greedy_tokens_match_transformers_with_chunked_prefill_and_batched_decode(tiny_dir, hf):
    llm = hybrid_llm(tiny_dir, max_num_batched_tokens=16)
    prompts = [prompt(n, seed=100 + n, vocab_size=384) for n in (17, 29, 48)]
    for token_ids, out in zip(prompts, generate(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids)
    pool = llm.engine.core.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # every block given back


def test_freed_local_blocks_reused_by_other_requests_keep_every_answer(tiny_dir, hf):
    """A pool of 160 pages (one max_model_len sequence needs 144 without freeing) and four 80-token sequences at
    once: local blocks freed by one request are taken by another while all run (85 pages held by more than one
    request in turn when this was written)."""
    llm = hybrid_llm(tiny_dir, kv_cache_bytes=160 * 1024, max_model_len=96, max_num_batched_tokens=24)
    assert llm.engine.core.kv_plan.num_blocks == 160
    prompts = [prompt(48, seed=200 + i, vocab_size=384) for i in range(4)]
    for token_ids, out in zip(prompts, generate(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids)


def test_local_blocks_are_freed_while_a_long_sequence_decodes(tiny_dir):
    llm = hybrid_llm(tiny_dir)
    core = llm.engine.core
    request_id = "long"
    core.add_request(request_id, prompt(40, seed=3, vocab_size=384), SamplingParams(temperature=0, max_tokens=30,
                                                                                   ignore_eos=True))
    kv = core.scheduler.kv_manager
    for _ in range(20):
        core.step()
    request = core.scheduler.requests[request_id]
    tables = kv.get_block_ids(request)
    num_blocks = len(tables[0])
    assert 0 not in tables[0] and num_blocks == -(-request.num_computed_tokens // BLOCK_SIZE)
    # A local group keeps only the blocks its next query can read (window 8: at most 3 blocks of 4, plus the one
    # a step may lag behind), the global group every block.
    for table in tables[1:]:
        assert sum(block_id != 0 for block_id in table) <= 4
        assert table[: num_blocks - 4] == [0] * (num_blocks - 4)
    assert kv.num_held_blocks(request) <= num_blocks + 5 * 4


def test_a_resent_conversation_hits_its_prefix_and_replays_little(tiny_dir):
    shared = prompt(60, seed=7, vocab_size=384)
    first, second = shared + prompt(6, seed=8, vocab_size=384), shared + prompt(9, seed=9, vocab_size=384)
    warm = hybrid_llm(tiny_dir)
    generate(warm, [first])
    hit = generate(warm, [second])[0]
    kv = warm.engine.core.scheduler.kv_manager
    # 60 shared tokens = 15 full blocks; the window before 60 (53..59) is cached: no replay.
    assert hit.num_cached_tokens == 60 and kv.num_replayed_tokens == 0
    cold = LLM(str(tiny_dir), block_size=BLOCK_SIZE, progress=False, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == generate(cold, [second])[0].outputs[0].token_ids


def test_a_hit_whose_window_was_evicted_replays_from_a_checkpoint(tiny_dir):
    """Once a request's last windows are evicted, a request with its prompt reuses the global blocks up to a
    checkpoint (a multiple of 16 tokens, whose window was evicted last) and replays the rest: the same tokens as a
    cold engine."""
    base = prompt(62, seed=11, vocab_size=384)
    warm = hybrid_llm(tiny_dir, max_model_len=96)
    core = warm.engine.core
    generate(warm, [base + [5]], SamplingParams(temperature=0, max_tokens=1))
    pool = core.scheduler.block_pool
    protected = [b.block_id for b in pool.blocks if b.protected]
    assert protected  # the windows before 16, 32, 48 and 64 wait in the protected queue
    # Evict every local block that is not protected (as other requests' allocations would, before the global
    # blocks, here held meanwhile).
    global_blocks = [b for b in pool.cached_block_hash_to_block.values() if b.group == 0]
    pool.touch(global_blocks)
    taken = pool.get_new_blocks(pool.free_block_queue.num_free_blocks)
    pool.free_blocks(taken)
    pool.free_blocks(global_blocks)
    out = generate(warm, [base + [6]], GREEDY)[0]
    kv = core.scheduler.kv_manager
    # 60 tokens of global blocks cached; the hit at 60 needs local block 13 (53..56), at 52 block 12: evicted; the
    # window before the checkpoint 48 (41..47: blocks 10, 11) was protected: 48 reused, 12 replayed.
    assert out.num_cached_tokens == 48 and kv.num_replayed_tokens == 12
    cold = LLM(str(tiny_dir), block_size=BLOCK_SIZE, progress=False, enable_prefix_caching=False, max_model_len=96)
    assert out.outputs[0].token_ids == generate(cold, [base + [6]])[0].outputs[0].token_ids


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hybrid_checkpoint_tokens": 6}, "multiple of block_size"),
    ({"async_scheduling": True}, "async_scheduling"),
    ({"kv_host_cache_bytes": 1 << 20}, "kv_host_cache_bytes"),
    ({"batch_invariant": True}, "batch_invariant"),
])
def test_settings_it_does_not_run_with_are_refused(tiny_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hybrid_llm(tiny_dir, **kwargs)


def test_a_model_without_a_window_is_refused(tmp_path):
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="no sliding-window layer"):
        LLM(str(llama), progress=False, enable_hybrid_kv_cache=True)


def test_a_prefill_lease_is_refused(tiny_dir):
    core = hybrid_llm(tiny_dir).engine.core
    with pytest.raises(ValueError, match="cannot hand KV"):
        core.add_request("lease", prompt(12, seed=1, vocab_size=384), SamplingParams(max_tokens=1), hold_blocks=True)


@pytest.mark.parametrize("k", [3, "auto"])
def test_speculative_decoding_frees_rejected_drafts_in_every_group(tiny_dir, hf, k):
    """n-gram drafts on a prompt that repeats itself (so drafts are proposed, some rejected): transformers' greedy
    tokens, and every page back in the pool at the end (a rejected tail freed in each group)."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = hybrid_llm(tiny_dir, speculative_config=spec)
    motif = prompt(7, seed=5, vocab_size=384)
    prompts = [motif * 5, prompt(30, seed=6, vocab_size=384) + motif * 3]
    for token_ids, out in zip(prompts, generate(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids)
    core = llm.engine.core
    assert core.spec_decode_stats.num_draft_tokens > 0
    pool = core.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_without_prefix_caching_local_blocks_are_freed_uncached_and_the_tokens_hold(tiny_dir, hf):
    llm = hybrid_llm(tiny_dir, enable_prefix_caching=False, max_num_batched_tokens=16)
    prompts = [prompt(n, seed=300 + n, vocab_size=384) for n in (9, 33, 57)]
    for token_ids, out in zip(prompts, generate(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids)
    pool = llm.engine.core.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and not pool.cached_block_hash_to_block
