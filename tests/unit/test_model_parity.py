"""Our Llama-family models (loaded by our loader, run on the paged cache) against `transformers`.

Tolerance, stated once: |ours - hf| <= 1e-4 * max|hf logits| elementwise (float32, CPU); i.e. the error is
measured relative to the largest logit of the compared rows, not per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops
from deepinfer.loader.hf import load_model
from deepinfer.testing.checkpoints import LLAMA3_ROPE_SCALING, make_tiny_checkpoint

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


@dataclass
class PagedCache:
    """Per-layer KV caches plus a block table per sequence; blocks are handed out sequentially."""

    kv_caches: list[torch.Tensor]
    block_size: int = BLOCK_SIZE
    next_block: int = 0
    block_tables: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PagedCache:
        """Caches filled with random junk: every read slot must have been written first."""
        c = model.config
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
        return cls([torch.randn(shape) * 10 for _ in range(c.num_hidden_layers)])

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 of a sequence, allocating blocks as needed."""
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < end:
            table.append(self.next_block)
            self.next_block += 1
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def step(self, model: torch.nn.Module, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """One forward over a ragged batch of (seq_id, new token ids, first position); logits per chunk."""
        input_ids, positions, slot_mapping = [], [], []
        for seq_id, token_ids, start in chunks:
            input_ids += token_ids
            positions += range(start, start + len(token_ids))
            slot_mapping += self.slots(seq_id, start, start + len(token_ids))
        meta = build_attention_metadata(
            query_lens=[len(t) for _, t, _ in chunks],
            seq_lens=[start + len(t) for _, t, start in chunks],
            block_tables=[self.block_tables[seq_id] for seq_id, _, _ in chunks],
            slot_mapping=slot_mapping,
        )
        with torch.no_grad():
            hidden = model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
            logits = model.compute_logits(hidden)
        return list(logits.split([len(t) for _, t, _ in chunks]))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Elementwise error within REL_TOL of the largest reference logit."""
    assert ours.shape == ref.shape, f"{what}: shapes {tuple(ours.shape)} vs {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max error {err:.3g} > {REL_TOL} * max|logit| {scale:.3g}"


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """Random token ids, avoiding the special tokens 0..3."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (length,), generator=generator).tolist()


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
    (logits,) = PagedCache.for_model(ours).step(ours, [(0, token_ids, 0)])
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0].float()
    assert_close(logits, ref, "prefill logits")


def test_greedy_tokens_match_generate(models):
    ours, hf = models
    token_ids = prompt(19, seed=2, vocab_size=ours.config.vocab_size)
    cache = PagedCache.for_model(ours)
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
    batched = PagedCache.for_model(ours).step(ours, [(i, p, 0) for i, p in enumerate(prompts)])
    for i, token_ids in enumerate(prompts):
        (alone,) = PagedCache.for_model(ours).step(ours, [(0, token_ids, 0)])
        assert_close(batched[i], alone, f"prompt {i} in a batch")


def test_prefix_reuse_matches_cold_run(models):
    ours, _ = models
    vocab = ours.config.vocab_size
    token_ids = prompt(27, seed=3, vocab_size=vocab)
    (cold,) = PagedCache.for_model(ours).step(ours, [(0, token_ids, 0)])
    warm_cache = PagedCache.for_model(ours)
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
