"""DeepSeek V2/V3 (our loader, paged latent cache) against transformers' DeepseekV2/V3ForCausalLM and MtpModel.

Tolerance as in test_model_parity: |ours - hf| <= 1e-4 * max|hf logits| elementwise (float32, CPU).
Weights are drawn with std 0.4: the smallest top-2 logit gap measured over these prompts is ~1.7e-2, far
above the ~5e-5 absolute differences, so greedy tokens and expert choices have clear winners.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.kernels import get_ops
from deepinfer.loader.hf import iter_safetensors, load_model
from deepinfer.testing.checkpoints_deepseek import DEEPSEEK_YARN, make_tiny_deepseek_checkpoint
from deepinfer.testing.paged_cache import PagedCache, assert_close_logits
from deepinfer.testing.paged_cache import random_prompt as prompt

REL_TOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64

CASES = {
    # dense first layer, 4 expert groups (2 picked), shared expert, q-LoRA, YaRN + mscale, an MTP layer
    "v3-yarn-mtp": ("deepseek_v3", {"rope_parameters": DEEPSEEK_YARN, "num_nextn_predict_layers": 1}),
    "v3-neox": ("deepseek_v3", {"rope_interleave": False, "norm_topk_prob": False}),
    "v2-lite": ("deepseek_v2", {"q_lora_rank": None}),  # V2-Lite: no q-LoRA, greedy softmax top-k
    "v2-grouped": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
}


paged = functools.partial(PagedCache.for_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
assert_close = functools.partial(assert_close_logits, rel_tol=REL_TOL)


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(our model, transformers model, checkpoint dir) from the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    arch, overrides = CASES[request.param]
    path = make_tiny_deepseek_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    ours = load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf, path


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] of one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match(models):
    ours, hf, _ = models
    token_ids = prompt(21, seed=1, vocab_size=ours.config.vocab_size)
    (logits,) = paged(ours).step(ours, [(0, token_ids, 0)])
    assert_close(logits, hf_logits(hf, token_ids), "prefill logits (naive MLA)")


def test_decode_logits_match(models):
    """Absorbed decode over the paged latent cache, one token at a time, against a full transformers forward."""
    ours, hf, _ = models
    token_ids = prompt(18, seed=5, vocab_size=ours.config.vocab_size)
    cache = paged(ours)
    cache.step(ours, [(0, token_ids[:6], 0)])
    rows = [cache.step(ours, [(0, [t], 6 + i)])[0][0] for i, t in enumerate(token_ids[6:])]
    assert_close(torch.stack(rows), hf_logits(hf, token_ids)[6:], "decode logits (absorbed MLA)")


def test_greedy_tokens_match_generate(models):
    ours, hf, _ = models
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
    ours, _, _ = models
    vocab = ours.config.vocab_size
    prompts = [prompt(n, seed=10 + n, vocab_size=vocab) for n in (7, 23, 13)]
    batched = paged(ours).step(ours, [(i, p, 0) for i, p in enumerate(prompts)])
    for i, token_ids in enumerate(prompts):
        (alone,) = paged(ours).step(ours, [(0, token_ids, 0)])
        assert_close(batched[i], alone, f"prompt {i} in a batch")


def test_prefix_reuse_matches_cold_run(models):
    ours, _, _ = models
    vocab = ours.config.vocab_size
    token_ids = prompt(27, seed=3, vocab_size=vocab)
    (cold,) = paged(ours).step(ours, [(0, token_ids, 0)])
    warm_cache = paged(ours)
    warm_cache.step(ours, [(0, token_ids[:16], 0)])
    # The suffix runs in one batch with a decode row (absorbed path) and a fresh prefill (naive path).
    other = prompt(9, seed=4, vocab_size=vocab)
    warm_cache.step(ours, [(1, other[:8], 0)])
    warm, _, _ = warm_cache.step(ours, [(0, token_ids[16:], 16), (1, other[8:], 8), (2, other, 0)])
    assert_close(warm, cold[16:], "suffix over a cached prefix")


def test_kv_bytes_per_token_is_latent_size(models):
    ours, _, _ = models
    c = ours.config
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    assert c.kv_bytes_per_token(torch.float32) == latent * c.num_hidden_layers * 4
    assert c.kv_bytes_per_token("bfloat16") == latent * c.num_hidden_layers * 2
    assert c.kv_cache_shape(10, BLOCK_SIZE) == (10, BLOCK_SIZE, latent)


def test_activation_headroom_counts_moe_pairs_and_mla_expansion(models):
    """Per batched token, bf16: max(dense MLP, MoE top-k pairs + router + shared experts) + MLA's K/V/Q."""
    c = models[0].config
    moe, h = c.moe, c.hidden_size
    dense = (4 * c.intermediate_size + 8 * h) * 2
    routed = moe.num_experts_per_tok * (moe.moe_intermediate_size * 2 + 4 * h) + 4 * moe.num_experts
    routed += 4 * moe.num_shared_experts * moe.moe_intermediate_size * 2 + 8 * h * 2
    mla = 4 * c.num_attention_heads * c.mla.qk_head_dim * 2
    assert c.activation_bytes_per_token(2) == max(dense, routed) + mla


# -- MTP ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """(ours, transformers model, transformers MtpModel) of the V3 checkpoint with an MTP layer."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    arch, overrides = CASES["v3-yarn-mtp"]
    path = make_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("mtp"), arch, **overrides)
    ours = load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    assert ours.num_mtp_layers == 1
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf, _hf_mtp_model(hf, path, ours.config.num_hidden_layers)


def _hf_mtp_model(hf, path, num_layers: int):
    """transformers' MtpModel with the checkpoint's model.layers.{num_layers}.* tensors renamed into it."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(hf, 1).eval()
    prefix = f"model.layers.{num_layers}."
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
    for name, tensor in iter_safetensors(path):
        if not name.startswith(prefix):
            continue
        rest = name.removeprefix(prefix)
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts[proj][int(e)] = tensor
        elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            state[f"layers.0.{rest}"] = tensor
        elif rest == "shared_head.norm.weight":
            state["layers.0.post_norm.weight"] = tensor
        else:
            state[f"layers.0.mtp_block.{rest}"] = tensor
    n = len(experts["down_proj"])
    gate_up = [torch.cat((experts["gate_proj"][e], experts["up_proj"][e])) for e in range(n)]
    state["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(n)])
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
    return mtp


def _main_then_mtp(ours, token_ids: list[int], next_ids: list[int], hidden_override=None) -> torch.Tensor:
    """Main-model prefill, then the MTP layer over the same positions/slots in its own latent cache."""
    cache = paged(ours, num_layers=ours.config.num_hidden_layers + 1)
    input_ids, positions, meta = cache.inputs([(0, token_ids, 0)])
    with torch.no_grad():
        hidden = ours(input_ids, positions, cache.kv_caches[:-1], meta)
        if hidden_override is not None:
            hidden = hidden_override(hidden)
        return ours.mtp_forward(hidden, torch.tensor(next_ids), positions, cache.kv_caches[-1], meta)


def test_mtp_matches_transformers_mtp_model(mtp_models):
    ours, hf, hf_mtp = mtp_models
    token_ids = prompt(15, seed=7, vocab_size=ours.config.vocab_size)
    next_ids = token_ids[1:] + [9]
    logits = _main_then_mtp(ours, token_ids, next_ids)
    assert logits.shape == (15, ours.config.vocab_size)
    with torch.no_grad():
        hidden = hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]
        position_ids = torch.arange(1, 16)[None]  # transformers runs t+1 at its own position
        out = hf_mtp.forward_layer(0, hidden, position_ids, None, input_ids=torch.tensor([next_ids]))
        ref = hf_mtp._project_to_logits(out)[0].float()
    assert_close(logits, ref, "MTP logits")


def test_mtp_is_deterministic_and_uses_both_inputs(mtp_models):
    ours, _, _ = mtp_models
    token_ids = prompt(11, seed=8, vocab_size=ours.config.vocab_size)
    next_ids = token_ids[1:] + [5]
    first = _main_then_mtp(ours, token_ids, next_ids)
    assert torch.equal(first, _main_then_mtp(ours, token_ids, next_ids))
    other_next = list(next_ids)
    other_next[-1] = 6
    changed = _main_then_mtp(ours, token_ids, other_next)
    # Causal: only the last row sees the changed token (others differ by matmul rounding as expert groups change).
    torch.testing.assert_close(changed[:-1], first[:-1], rtol=0, atol=1e-4)
    assert not torch.allclose(changed[-1], first[-1], atol=1e-3)
    perturbed = _main_then_mtp(ours, token_ids, next_ids, hidden_override=lambda h: h + 0.5 * torch.randn_like(h))
    assert not torch.allclose(perturbed, first, atol=1e-3)


# -- the offline engine ---------------------------------------------------------------------------------------


def test_llm_runs_deepseek_with_latent_cache_and_prefix_hits(mtp_models, tmp_path_factory):
    """LLM end to end on the V3+MTP checkpoint: KV planned per latent row, greedy tokens = transformers,
    and a second run hits the prefix cache with the same tokens."""
    from deepinfer import LLM, SamplingParams

    _, hf, _ = mtp_models
    path = make_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("llm"), *CASES["v3-yarn-mtp"][:1],
                                         **CASES["v3-yarn-mtp"][1])
    llm = LLM(str(path), block_size=4, progress=False)
    c, engine = llm.engine.core.model_config, llm.engine.core
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    assert c.kv_bytes_per_token(torch.float32) == latent * c.num_hidden_layers * 4
    assert engine.kv_plan.bytes_per_block == latent * c.num_hidden_layers * 4 * 4
    assert all(kv.shape == (engine.kv_plan.num_blocks, 4, latent) for kv in engine.runner.kv_caches)
    prompts = [{"prompt_token_ids": prompt(22, seed=21, vocab_size=c.vocab_size)},
               {"prompt_token_ids": prompt(9, seed=22, vocab_size=c.vocab_size)}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = llm.generate(prompts, params, use_tqdm=False)
    warm = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in cold] == [0, 0]
    assert [o.num_cached_tokens for o in warm] == [20, 8]
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]["prompt_token_ids"]]), do_sample=False, max_new_tokens=10,
                          pad_token_id=1)
    assert cold[0].outputs[0].token_ids == ref[0, 22:].tolist()
