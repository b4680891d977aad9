"""Micro-bench of one layer's CPU prefill attention: torch's flash kernel (sdpa_paged.fused_causal_attention) against the
blocked matmul path (blocked_attention.blocked_causal_attention), default model's shape (9 query heads over 3 KV
heads, head dim 64).

    PYTHONPATH=shared:. python bench/cpu/cpu_attention.py [--lengths 2048,6000,8000] [--threads 1,2] [--dtypes bfloat16,float32]
                                  [--blocks 64,128,256] [--chunk 0] [--repeats 3]

--chunk C > 0 times the last C-query chunk over the rest of the L keys as cached prefix (the engine's chunked
prefill) instead of the whole cold prompt. Prints one line per point: median milliseconds of each, the ratio flash /
blocked (> 1 = blocked faster), the max abs difference against a float32 reference of the same inputs, and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from deepinfer.kernels.blocked_attention import blocked_causal_attention
from deepinfer.kernels.sdpa_paged import fused_causal_attention


def _median_ms(attention, args: tuple, repeats: int) -> float:
    attention(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        attention(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,6000,8000")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--blocks", default="128")
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", default="9,3,64", help="Hq,Hkv,D")
    args = parser.parse_args()
    num_heads, num_kv_heads, head_dim = map(int, args.heads.split(","))
    scale = head_dim**-0.5
    for length in map(int, args.lengths.split(",")):
        g = torch.Generator().manual_seed(length)
        num_queries = args.chunk or length
        q32 = torch.randn(1, num_heads, num_queries, head_dim, generator=g)
        k32 = torch.randn(1, num_kv_heads, length, head_dim, generator=g) * 2
        v32 = torch.randn(1, num_kv_heads, length, head_dim, generator=g)
        # the engine's layout: rows [S, Hkv, D] seen heads-first
        k32, v32 = (x[0].transpose(0, 1).contiguous().transpose(0, 1)[None] for x in (k32, v32))
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            q, k, v = (x.to(dtype) for x in (q32, k32, v32))
            reference = fused_causal_attention(q.float(), k.float(), v.float(), scale)
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                flash_ms = _median_ms(fused_causal_attention, (q, k, v, scale), args.repeats)
                for block in map(int, args.blocks.split(",")):
                    out = blocked_causal_attention(q, k, v, scale, block_q=block)
                    err = (out.float() - reference).abs().max().item()
                    flash_err = (
                        (fused_causal_attention(q, k, v, scale).float() - reference).abs().max().item()
                    )
                    ms = _median_ms(blocked_causal_attention, (q, k, v, scale, None, block), args.repeats)
                    print(
                        f"L={length} Q={num_queries} {str(dtype)[6:]} threads={threads} Bq={block}: flash "
                        f"{flash_ms:.0f} ms, blocked {ms:.0f} ms, ratio {flash_ms / ms:.2f}; max err blocked "
                        f"{err:.1e} flash {flash_err:.1e}; load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
