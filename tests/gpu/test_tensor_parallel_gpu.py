"""TP=2 on two GPUs (NCCL) against TP=1 on a Llama-3.1-8B-shaped random model, and decode tok/s side by side.

Same model at both sizes: the TP=2 ranks draw the single-rank "dummy" weights (same seed) and keep their
slices (deepinfer.loader.shard), so no checkpoint is written. Tolerance, stated once: the bf16 noise of
a position is TOL_FACTOR times max |TP=1 bf16 - TP=1 fp32| over the vocabulary, the fp32 model being the bf16
one upcast (same weights); TP=2 bf16 logits must lie within it, and greedy tokens must equal TP=1's up to the
first position where the fp32 top-2 margin is below it.
Runs on a bare GPU image: `PYTHONPATH=shared python -m pytest tests/gpu/test_tensor_parallel_gpu.py -q -s
--noconftest`.
"""

from __future__ import annotations

import copy
import gc
import json
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

TOL_FACTOR = 3.0
BLOCK_SIZE, NUM_BLOCKS = 16, 512
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json alone: weights come from load_format="dummy"."""
    path = tmp_path_factory.mktemp("llama-8b-shape")
    (path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    return path


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _steps(prompts: list[list[int]], num_decode: int):
    """(chunks, block tables) per step: one prefill of every prompt, then decode steps (tokens filled later)."""
    tables = [list(range(1 + i * 8, 1 + (i + 1) * 8)) for i in range(len(prompts))]  # 8 blocks = 128 tokens
    yield [(p, 0) for p in prompts], tables
    for step in range(num_decode):
        yield [(None, len(p) + step) for p in prompts], tables


def _run(model, config, prompts, fed_tokens, caches, device):
    """Logits of the last row of each prompt at every step [steps, B, vocab]; decode feeds `fed_tokens`."""
    from deepinfer.kernels import build_attention_metadata

    out = []
    for step, (chunks, tables) in enumerate(_steps(prompts, len(fed_tokens))):
        if step:
            chunks = [([t], start) for t, (_, start) in zip(fed_tokens[step - 1], chunks, strict=True)]
        ids = torch.tensor([t for toks, _ in chunks for t in toks], device=device)
        positions = torch.tensor([s + i for toks, s in chunks for i in range(len(toks))], device=device)
        slots = [tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for b, (toks, s) in enumerate(chunks) for p in range(s, s + len(toks))]
        meta = build_attention_metadata([len(t) for t, _ in chunks], [s + len(t) for t, s in chunks], tables,
                                        slots, device=device)
        rows = torch.tensor(meta.query_start_loc_cpu[1:], device=device) - 1
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids, positions, caches, meta)[rows]).float())
    return torch.stack(out)


def test_tp2_logits_and_greedy_tokens_match_tp1(model_dir):
    from deepinfer.distributed.parallel_state import free_tcp_init_method
    from deepinfer.executor.tensor_parallel import WorkerSpec, spawn_tensor_parallel
    from deepinfer.kernels import get_ops
    from deepinfer.loader.dummy import load_dummy_model
    from deepinfer.loader.hf import load_model_config
    from deepinfer.models.parallel import shard_config

    config, ops, cuda0 = load_model_config(model_dir), get_ops("cuda"), torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 64, 100)]
    num_decode = 12

    def caches(cfg, dtype):
        return [torch.zeros(cfg.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), dtype=dtype, device=cuda0)
                for _ in range(cfg.num_hidden_layers)]

    bf16 = load_dummy_model(model_dir, torch.bfloat16, cuda0, ops, seed=0)
    fp32 = copy.deepcopy(bf16).float()
    # greedy path of the fp32 model, fed to every run so all see the same inputs
    fed: list[list[int]] = []
    for step in range(num_decode + 1):
        ref32 = _run(fp32, config, prompts, fed, caches(config, torch.float32), cuda0)
        if step < num_decode:
            fed.append(ref32[step].argmax(-1).tolist())
    del fp32
    ref16 = _run(bf16, config, prompts, fed, caches(config, torch.bfloat16), cuda0)
    del bf16
    _free()
    spec = WorkerSpec(model_dir=str(model_dir), dtype=torch.bfloat16, device_type="cuda", accelerator="cuda",
                      tp_size=2, backend="nccl", init_method=free_tcp_init_method(), load_format="dummy")
    driver = spawn_tensor_parallel(spec, ops)
    try:
        tp2 = _run(driver, config, prompts, fed, caches(shard_config(config, 2), torch.bfloat16), cuda0)
    finally:
        driver.close()
    tol = TOL_FACTOR * (ref16 - ref32).abs().amax(-1)  # [steps, B]
    err = (tp2 - ref16).abs().amax(-1)
    print(f"\nTP=2 vs TP=1 bf16: max logit error {err.max().item():.4f}, bf16 tolerance min {tol.min().item():.4f}")
    assert (err <= tol).all(), f"TP=2 logits off by {err.max().item():.4f} (tolerance {tol.min().item():.4f})"
    top2 = ref32.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    for b in range(len(prompts)):
        for step in range(num_decode + 1):
            if margin[step, b] < tol[step, b]:
                break  # a near-tie: later tokens may legitimately differ
            assert tp2[step, b].argmax().item() == ref32[step, b].argmax().item(), (b, step)


def _decode_tok_s(llm_factory, batch: int, num_tokens: int) -> float:
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, 128000, (32,), generator=g).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    with llm_factory() as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    _free()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def test_decode_tok_s_batch_64_tp1_vs_tp2(model_dir):
    from deepinfer import LLM

    common = {"load_format": "dummy", "enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 64,
              "kv_cache_bytes": 8 << 30, "progress": False}
    tp1 = _decode_tok_s(lambda: LLM(str(model_dir), tensor_parallel_size=1, **common), 64, 128)
    tp2 = _decode_tok_s(lambda: LLM(str(model_dir), tensor_parallel_size=2, **common), 64, 128)
    print(f"\ndecode tok/s at batch 64 (eager, 32-token prompts, 128 new tokens): TP=1 {tp1:.0f}  TP=2 {tp2:.0f}")
    assert tp1 > 0 and tp2 > 0
