"""Gemma 3 on the GPU (Triton kernels, float32) against transformers on the GPU (float32, eager attention) on a
tiny random checkpoint: five local layers with a 24-key window, then a global one. Prompts from under the window
to five windows long, prefilled in chunks of a 64-token budget, decoded past the window; every execution mode
(eager, decode graphs, piecewise and full graphs of prompt steps), and the same prompts again as prefix-cache hits.

Tolerance, stated once: float32 on both sides (the Triton dots run in ieee float32), so greedy tokens must be
equal up to the first position where the reference's top-2 margin is below FP32_REL_TOL x max|logit| (a near tie:
from there the tokens may legitimately part); at least MIN_COMPARED of the tokens must be compared.
Runs on a bare GPU image: `PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_checkpoints import checkpoints  # noqa: E402  (deepinfer.testing by path: no bus on the GPU image)

WINDOW = 24
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "max_position_embeddings": 1024}
#: under, at and just past the window, then several windows (130: three 64-token prefill chunks)
LENGTHS = (5, 23, 24, 25, 40, 77, 130)
NEW_TOKENS = 32
FP32_REL_TOL = 1e-3
MIN_COMPARED = 0.75
MODES = ("eager", "decode", "piecewise", "full")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints.make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", sliding_window=WINDOW,
                                            seed=5, **SHAPE)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 384, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Per prompt: transformers' greedy tokens and, per token, whether it is compared (no near tie up to it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              attn_implementation="eager").cuda().eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    results = []
    for prompt in prompts():
        with torch.inference_mode():
            gen = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=1)
        tokens = gen.sequences[0, len(prompt):].tolist()
        num_clear = 0
        for logits in gen.logits:
            top2 = logits[0].float().topk(2).values
            if (top2[0] - top2[1]).item() < FP32_REL_TOL * logits[0].float().abs().max().item():
                break
            num_clear += 1
        results.append((tokens, num_clear))
    del model
    torch.cuda.empty_cache()
    return results


def engine(checkpoint, mode: str):
    """Our LLM on cuda, float32, the Triton kernels, a 64-token step budget (long prompts prefill in chunks)."""
    from deepinfer import LLM

    return LLM(str(checkpoint), device="cuda", dtype="float32", accelerator="cuda", progress=False,
               kv_cache_bytes=64 << 20, max_num_seqs=8, max_num_batched_tokens=64, execution_mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_match_transformers_in_every_execution_mode(checkpoint, reference, mode):
    from deepinfer import SamplingParams

    llm = engine(checkpoint, mode)
    runner = llm.engine.core.runner
    assert llm.engine.execution_mode == mode
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts()]
    cold = llm.generate(batch, params, use_tqdm=False)
    compared = 0
    for out, (want, num_clear) in zip(cold, reference, strict=True):
        got = out.outputs[0].token_ids
        assert got[:num_clear] == want[:num_clear], (mode, num_clear, got, want)
        compared += num_clear
    print(f"{mode}: {compared} of {len(LENGTHS) * NEW_TOKENS} greedy tokens compared before a near tie")
    assert compared >= MIN_COMPARED * len(LENGTHS) * NEW_TOKENS, f"only {compared} tokens compared"
    if mode != "eager":
        assert runner.graphs is not None and runner.graphs.num_replays > 0, "decode steps should replay graphs"
    if mode in ("piecewise", "full"):
        prompt_graphs = runner.full_graphs if mode == "full" else runner.piecewise
        assert prompt_graphs is not None and prompt_graphs.num_runs > 0, "prompt steps should run the graphs"
    # The same prompts again: prefix-cache hits over all but the last block of each prompt, in every layer.
    warm = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert max(o.num_cached_tokens for o in warm) > 4 * WINDOW


def test_kv_by_layer_type_matches_transformers(checkpoint, reference):
    """enable_hybrid_kv_cache on the GPU (eager steps, the Triton kernels reading each layer's group table, the
    groups' layers sharing caches): transformers' tokens, prefix-cache hits giving the cold tokens, and a pool of
    pages small enough that freed local blocks are taken by other requests meanwhile."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(checkpoint), device="cuda", dtype="float32", accelerator="cuda", progress=False,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, enable_hybrid_kv_cache=True,
              hybrid_checkpoint_tokens=64, kv_cache_bytes=200 * 2 * 16 * 2 * 32 * 4)  # 200 pages of one layer
    core = llm.engine.core
    assert len(core.kv_groups) == 6 and core.execution_mode == "eager"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts()]
    cold = llm.generate(batch, params, use_tqdm=False)
    compared = 0
    for out, (want, num_clear) in zip(cold, reference, strict=True):
        assert out.outputs[0].token_ids[:num_clear] == want[:num_clear], (num_clear, out.outputs[0].token_ids, want)
        compared += num_clear
    assert compared >= MIN_COMPARED * len(LENGTHS) * NEW_TOKENS, f"only {compared} tokens compared"
    warm = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert max(o.num_cached_tokens for o in warm) > 4 * WINDOW
    pool = core.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1
