"""What the GPU benches share (bench/gpu/gpu.py, gpu_deepseek.py, gpu_hf.py, gpu_moe_tiles.py, the decode-step
probes): the Llama-3.1-8B shape, timing on the device, the ceilings of the run, our engine over random weights."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.gpu_decode import greedy

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16", "hidden_act": "silu",
}
PREFILL_SEQS, PREFILL_LEN = 4, 4096


def timed(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds of fn() (synchronised on both sides)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings() -> dict:
    """bf16 8192^3 matmul TFLOP/s and a 1 GiB device copy in GB/s (read + write), random data."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_s = timed(lambda: [a @ b for _ in range(10)], reps=5, warmup=1) / 10
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    cp_s = timed(lambda: [dst.copy_(src) for _ in range(10)], reps=5, warmup=1) / 10
    return {"matmul_tflops": round(2 * n**3 / mm_s / 1e12, 1), "copy_gb_s": round(2 * src.nbytes / cp_s / 1e9, 1)}


#: --execution-mode (EngineArgs.execution_mode): which steps replay CUDA graphs.
EXECUTION_MODE = "full"


def make_engine(model_dir: Path, max_num_seqs: int = 256, batch_invariant: bool = False,
                async_scheduling: bool = False, graph_sampling: bool = True):
    """Our engine over the config alone (load_format="dummy"), CUDA graphs on."""
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=8192,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=PREFILL_SEQS * PREFILL_LEN,
                      enable_kv_events=False, progress=False, gpu_memory_utilization=0.9,
                      batch_invariant=batch_invariant, async_scheduling=async_scheduling,
                      execution_mode=EXECUTION_MODE, graph_sampling=graph_sampling)
    start = time.perf_counter()
    engine = EngineCore(args)
    for cache in engine.runner.kv_caches:  # random KV (never zeros): decode reads it at full width
        cache.normal_(0, 1)
    # As the worker does after start-up: without it a timed window can hold a gen-2 collection over every start-up
    # object (one 171 ms step among 32 at B=256 on 2026-12-04, read as a 15% slower decode).
    gc.collect()
    gc.freeze()
    return engine, time.perf_counter() - start


def release_engines() -> None:
    """Free the engines a section dropped: make_engine froze their objects (gc.freeze), which a plain gc.collect()
    never frees, so the next engine would find the device memory still held."""
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


def prefill_ours(engine, rng, reps: int = 3, num_seqs: int = PREFILL_SEQS, seq_len: int = PREFILL_LEN) -> float:
    """Median seconds of one engine step over num_seqs fresh random seq_len-token prompts (cold: no prefix hits)."""
    vocab = engine.model_config.vocab_size

    def step():
        for _ in range(num_seqs):
            engine.add_request(f"p{rng.integers(1 << 62)}", rng.integers(0, vocab, seq_len).tolist(), greedy(1))
        outputs = engine.step()
        while len(outputs) < num_seqs and engine.has_unfinished_requests():  # async: tokens come a step later
            outputs += engine.step()
        assert len(outputs) == num_seqs and all(o.finish_reason for o in outputs), outputs

    return timed(step, reps)


def guarded(res: dict, key: str, fn) -> None:
    """Run a group of sections; a failure is recorded in the results (and printed), the run goes on."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - a bench reports every failure and keeps the rest of its numbers
        import traceback

        res[key] = traceback.format_exc()[-2000:]
        print(res[key])
