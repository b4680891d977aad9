"""The whole model on the GPU (Triton kernels) against `transformers` on the same random weights, and every
execution mode (CUDA graphs of decode and prompt steps, with and without their sampling tail) against eager.

Tolerance, stated once: the reference is transformers in float32; the bf16 tolerance of a prompt is
TOL_FACTOR times the largest logit error of transformers itself run in bf16 on the same weights (the rounding
noise of bf16, measured per position, not guessed). Our bf16 logits must lie within it; greedy tokens must be
equal up to the first position where the reference's top-2 margin is below it.
DeepSeek-V3 runs in float32 (tolerance FP32_REL_TOL x max|logit| per position): its sigmoid router squeezes
expert scores together, so bf16 noise flips expert choices, ours and transformers' at different positions.
Runs on a bare GPU image: `PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL_FACTOR = 3.0
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32}
# wide enough that the Triton tiles are exercised (64 experts, kv_lora_rank 128, 16 heads)
DEEPSEEK_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
                  "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                  "n_routed_experts": 64, "num_experts_per_tok": 6}
NEW_TOKENS = 24
MODEL_DTYPES = {"llama": torch.bfloat16, "deepseek_v2": torch.bfloat16, "deepseek_v3": torch.float32}
FP32_REL_TOL = 1e-3


@pytest.fixture(scope="module", params=list(MODEL_DTYPES))
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def dtype(model_name):
    return MODEL_DTYPES[model_name]


@pytest.fixture(scope="module")
def checkpoint(model_name, tmp_path_factory):
    """Tiny-ish random models with clear greedy winners: a Llama with llama3 RoPE scaling, and DeepSeek V2
    (V2-Lite routing: softmax greedy top-k, no q-LoRA) and V3 (grouped sigmoid routing, q-LoRA, YaRN) with MLA
    over the paged latent cache and the Triton fused-MoE and MLA decode kernels."""
    from deepinfer.testing import checkpoints, checkpoints_deepseek

    path = tmp_path_factory.mktemp(model_name)
    if model_name == "llama":
        return checkpoints.make_tiny_checkpoint(path, "llama", std=0.1, seed=3,
                                                rope_scaling=checkpoints.LLAMA3_ROPE_SCALING, **SHAPE)
    overrides = DEEPSEEK_SHAPE | ({"q_lora_rank": None} if model_name == "deepseek_v2" else
                                 {"rope_parameters": checkpoints_deepseek.DEEPSEEK_YARN})
    return checkpoints_deepseek.make_tiny_deepseek_checkpoint(path, model_name, std=0.1, seed=3, **overrides)


def hf_model(checkpoint, dtype):
    """transformers on the GPU (sdpa)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
    return model.cuda().eval()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers in float32: the oracle."""
    return hf_model(checkpoint, torch.float32)


@pytest.fixture(scope="module")
def tolerance(checkpoint, reference, dtype):
    """token ids -> per position: bf16, TOL_FACTOR * max over the vocabulary of |transformers bf16 - fp32| logits;
    float32, FP32_REL_TOL * max |fp32 logits|."""
    half = hf_model(checkpoint, torch.bfloat16) if dtype == torch.bfloat16 else None

    def tolerance(token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device="cuda")
        with torch.inference_mode():
            ref = reference(ids).logits.float()
            if half is None:
                return FP32_REL_TOL * ref.abs().amax(dim=-1)[0]
            noise = (half(ids).logits.float() - ref).abs().amax(dim=-1)[0]
        return TOL_FACTOR * noise  # [T]

    return tolerance


def prompts(n: int, vocab: int = 384, seed: int = 0) -> list[list[int]]:
    """Random prompts of varied lengths (never a single repeated token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 90, (n,), generator=g)]


def engine(checkpoint, dtype, **kwargs):
    """Our LLM on cuda with the Triton kernels."""
    from deepinfer import LLM

    return LLM(str(checkpoint), device="cuda", dtype=str(dtype).removeprefix("torch."), accelerator="cuda",
               progress=False,
               kv_cache_bytes=64 << 20, **kwargs)


def test_prefill_logits_match_transformers(checkpoint, dtype, reference, tolerance):
    from deepinfer.kernels import build_attention_metadata, get_ops
    from deepinfer.loader.hf import load_model

    model = load_model(checkpoint, dtype, "cuda", get_ops("cuda"), progress=False)
    cfg = model.config
    seqs = prompts(3, seed=1)
    block_size, next_block = 16, 1
    kv = [torch.randn(cfg.kv_cache_shape(64, block_size), device="cuda", dtype=dtype)
          for _ in range(cfg.num_hidden_layers)]
    tables, slots = [], []
    for seq in seqs:
        n = -(-len(seq) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(len(seq))]
    meta = build_attention_metadata([len(s) for s in seqs], [len(s) for s in seqs], tables, slots, device="cuda")
    flat = torch.tensor([t for s in seqs for t in s], device="cuda")
    positions = torch.tensor([p for s in seqs for p in range(len(s))], device="cuda")
    with torch.inference_mode():
        ours = model.compute_logits(model(flat, positions, kv, meta)).split([len(s) for s in seqs])
        for seq, logits in zip(seqs, ours, strict=True):
            ref = reference(torch.tensor([seq], device="cuda")).logits[0].float()
            err, tol = (logits - ref).abs().amax(dim=-1), tolerance(seq)
            assert torch.isfinite(logits).all() and bool((err <= tol).all()), (err.max(), tol.min())


def test_greedy_tokens_match_transformers_up_to_a_near_tie(checkpoint, dtype, reference, tolerance):
    from deepinfer import SamplingParams

    llm = engine(checkpoint, dtype)
    assert llm.engine.core.runner.graphs is not None
    batch = prompts(8, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert llm.engine.core.runner.graphs.num_replays > 0, "decode steps should have replayed CUDA graphs"
    compared = 0
    for prompt, out in zip(batch, outs, strict=True):
        with torch.inference_mode():
            gen = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=1)
        ref_tokens = gen.sequences[0, len(prompt):].tolist()
        # tolerance of the row that predicts generated token i: teacher-forced on the reference's own tokens
        near_tie = tolerance(gen.sequences[0].tolist())[len(prompt) - 1 :].tolist()
        for i, logits in enumerate(gen.logits):
            top2 = logits[0].float().topk(2).values
            if (top2[0] - top2[1]).item() < near_tie[i]:
                break  # a near tie: from here on the tokens may legitimately differ
            assert out.outputs[0].token_ids[i] == ref_tokens[i], (i, out.outputs[0].token_ids, ref_tokens)
            compared += 1
    print(f"{compared} greedy tokens compared before a near tie")
    # 3 tokens passed this bar on the H200 run of 2026-11-29 (random weights give thin top-2 margins)
    assert compared >= 3, f"only {compared} tokens compared: the margins are too thin to test"


#: (execution_mode, graph_sampling, async_scheduling) compared with eager: every mode, each graph tail on and off,
#: the default (full, tail, async) also synchronous.
MODES = [("decode", False, True), ("decode", True, False), ("piecewise", True, True), ("full", False, True),
         ("full", True, True), ("full", True, False)]


def generated(llm, batch: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def top2_margin(llm, context: list[int]) -> float:
    """The top-2 logprob (= logit) margin of the next token after `context`, teacher-forced on `llm`."""
    from deepinfer import SamplingParams

    out = llm.generate([{"prompt_token_ids": context}], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    first, second = sorted((lp.logprob for lp in out.logprobs[0].values()), reverse=True)[:2]
    return first - second


def test_every_execution_mode_against_eager(model_name, checkpoint, dtype, tolerance):
    """Graphs against eager, 11 prompts (a decode graph of 16: 5 padding rows), greedy and seeded random.
    float32: token for token. bfloat16: a graph's kernels may round differently from eager's (a padded bucket takes
    another GEMM or attention tile), so greedy tokens may part at a near tie only: at each prompt's first
    difference, eager's own top-2 margin there must lie within the bf16 noise (`tolerance`, TOL_FACTOR x
    transformers' bf16 error at that position). Batch-invariant bf16 (decode graphs; the Llama model, where
    tests/gpu/test_batch_invariant.py claims the mode): token for token."""
    from deepinfer import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    random = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
    batch = prompts(11, seed=4)
    eager = engine(checkpoint, dtype, max_num_seqs=16, execution_mode="eager")
    assert eager.engine.core.runner.graphs is None
    want, want_random = generated(eager, batch, greedy), generated(eager, batch[:3], random)
    near_ties = []
    for mode, tail, async_scheduling in MODES:
        llm = engine(checkpoint, dtype, max_num_seqs=16, execution_mode=mode, graph_sampling=tail,
                     async_scheduling=async_scheduling)
        got, got_random = generated(llm, batch, greedy), generated(llm, batch[:3], random)
        assert llm.engine.core.runner.graphs.num_replays >= NEW_TOKENS - 2, mode
        if dtype == torch.float32:
            assert (got, got_random) == (want, want_random), (mode, tail, async_scheduling)
            continue
        for prompt, a, b in zip(batch, want, got, strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if first is not None:
                context = prompt + a[:first]
                margin, bound = top2_margin(eager, context), tolerance(context)[-1].item()
                near_ties.append((mode, tail, first, round(margin, 4), round(bound, 4)))
                assert margin <= bound, f"{mode} (tail {tail}) parts from eager at token {first} with eager's top-2 " \
                                        f"margin {margin:.4f} above the bf16 noise {bound:.4f}: not a near tie"
        del llm
    print(f"modes that parted from eager at a near tie (mode, tail, token, margin, bound): {near_ties}")
    if model_name == "llama":
        invariant_eager = engine(checkpoint, dtype, max_num_seqs=16, execution_mode="eager", batch_invariant=True)
        invariant = engine(checkpoint, dtype, max_num_seqs=16, batch_invariant=True)
        assert invariant.engine.execution_mode == "decode"  # batch-invariant: decode graphs at most
        assert generated(invariant, batch, greedy) == generated(invariant_eager, batch, greedy)
        assert generated(invariant, batch[:3], random) == generated(invariant_eager, batch[:3], random)
