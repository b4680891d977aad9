"""Our Llama-family models (loaded by our loader, run on the paged cache) against `transformers`.

Tolerance, stated once: |ours - hf| <= 1e-4 * max|hf logits| elementwise (float32, CPU); i.e. the error is
measured relative to the largest logit of the compared rows, not per element.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.kernels import get_ops
from deepinfer.loader.hf import load_model
from deepinfer.testing.checkpoints import LLAMA3_ROPE_SCALING, make_tiny_checkpoint
from deepinfer.testing.paged_cache import PagedCache, assert_close_logits
from deepinfer.testing.paged_cache import random_prompt as prompt

REL_TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96

CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "mistral": ("mistral", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


paged = functools.partial(PagedCache.for_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
assert_close = functools.partial(assert_close_logits, rel_tol=REL_TOL)


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(our model, transformers model) loaded from the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    arch, overrides = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    ours = load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return ours, hf


def test_prefill_logits_match(models):
    ours, hf = models
    token_ids = prompt(21, seed=1, vocab_size=ours.config.vocab_size)
    (logits,) = paged(ours).step(ours, [(0, token_ids, 0)])
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0].float()
    assert_close(logits, ref, "prefill logits")


def test_greedy_tokens_match_generate(models):
    ours, hf = models
    token_ids = prompt(19, seed=2, vocab_size=ours.config.vocab_size)
    cache = paged(ours)
    (logits,) = cache.step(ours, [(0, token_ids, 0)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < 32:
        (logits,) = cache.step(ours, [(0, generated[-1:], len(token_ids) + len(generated) - 1)])
        generated.append(int(logits[-1].argmax()))
    hf.generation_config.eos_token_id = None  # a random model may emit eos: generate all 32 tokens
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([token_ids]), do_sample=False, max_new_tokens=32, pad_token_id=1, use_cache=True
        )
    assert out[0, len(token_ids) :].tolist() == generated


def test_ragged_batch_equals_each_prompt_alone(models):
    ours, _ = models
    vocab = ours.config.vocab_size
    prompts = [prompt(n, seed=10 + n, vocab_size=vocab) for n in (7, 23, 13)]
    batched = paged(ours).step(ours, [(i, p, 0) for i, p in enumerate(prompts)])
    for i, token_ids in enumerate(prompts):
        (alone,) = paged(ours).step(ours, [(0, token_ids, 0)])
        assert_close(batched[i], alone, f"prompt {i} in a batch")


def test_prefix_reuse_matches_cold_run(models):
    ours, _ = models
    vocab = ours.config.vocab_size
    token_ids = prompt(27, seed=3, vocab_size=vocab)
    (cold,) = paged(ours).step(ours, [(0, token_ids, 0)])
    warm_cache = paged(ours)
    warm_cache.step(ours, [(0, token_ids[:16], 0)])
    # The suffix runs in one batch with an unrelated decode row and a fresh prefill of another sequence.
    other = prompt(9, seed=4, vocab_size=vocab)
    warm_cache.step(ours, [(1, other[:8], 0)])
    warm, _, _ = warm_cache.step(ours, [(0, token_ids[16:], 16), (1, other[8:], 8), (2, other, 0)])
    assert_close(warm, cold[16:], "suffix over a cached prefix")


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": LLAMA3_ROPE_SCALING,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 0.5, "beta_fast": 16},
}


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_rope_tables_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from deepinfer.models import ModelConfig
    from deepinfer.models.rope import compute_inv_freq

    scaling = ROPE_SCALINGS[name]
    hf_config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=512,
        rope_theta=50000.0, rope_scaling=dict(scaling),
    )
    hf_config.architectures = ["LlamaForCausalLM"]
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, torch.device("cpu"))
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    assert config.rope_type == scaling["rope_type"]
    inv_freq, factor = compute_inv_freq(config, rotary_dim=64)
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)
