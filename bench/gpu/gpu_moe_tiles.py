"""Fused-MoE tile sweep on one GPU at DeepSeek-V2-Lite's expert shape (64 experts top-6, H 2048, I 1408, bf16).

    PYTHONPATH=shared:. python bench/gpu/gpu_moe_tiles.py [--tokens 1,64,8192]

For each token count: every candidate (block_m, block_n, block_k, warps, stages) checked against the torch
twin (relative L2 error) and timed, eagerly (host launches included) and as CUDA-graph replays (device time), beside the floor of that shape (touched expert bytes at the copy rate, or
FLOPs at the matmul rate, both measured here). Prints a table and one JSON line ($OUT/gpu-moe-tiles.json).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.gpu.harness import ceilings, timed

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 64, 6, 2048, 1408
CANDIDATES = {  # regime -> [(block_m, block_n, block_k, num_warps, num_stages)]
    "decode": [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (16, 64, 128, 4, 3), (16, 32, 128, 4, 4),
               (16, 128, 128, 8, 3), (16, 64, 256, 4, 3), (16, 32, 256, 4, 3)],
    "prefill": [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
                (64, 128, 128, 8, 3), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3)],
}


def make_inputs(num_tokens: int):
    """Random bf16 experts and softmax top-6 routing of random tokens."""
    torch.manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda") * INTER**-0.5).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), -1).topk(TOP_K, dim=-1)
    return hidden, w13, w2, weights.float(), ids


def floor_s(num_tokens: int, ids: torch.Tensor, ceil: dict) -> float:
    """max(touched expert weights / copy rate, GEMM FLOPs / matmul rate)."""
    touched = int(torch.unique(ids).numel())
    bytes_ = touched * 3 * HIDDEN * INTER * 2
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTER
    return max(bytes_ / (ceil["copy_gb_s"] * 1e9), flops / (ceil["matmul_tflops"] * 1e12))


def graph_ms(fn, replays: int = 20) -> float:
    """Device ms of fn() without the host: captured once in a CUDA graph, median over replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * timed(lambda: [graph.replay() for _ in range(replays)], 3) / replays


def sweep(num_tokens: int, ceil: dict) -> dict:
    """Every candidate of the token count's regime: error vs the twin and median ms."""
    from deepinfer.kernels import torch_moe, triton_moe

    hidden, w13, w2, weights, ids = make_inputs(num_tokens)
    ref = torch_moe.fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
    rows = {"default": None}
    regime = "decode" if num_tokens * TOP_K <= 16 * NUM_EXPERTS else "prefill"
    rows.update({str(c): c for c in CANDIDATES[regime]})
    out = {"floor_ms": round(1e3 * floor_s(num_tokens, ids, ceil), 4),
           "twin_ms": round(1e3 * timed(lambda: torch_moe.fused_moe(hidden, w13, w2, weights, ids), 5), 4)}
    for name, c in rows.items():
        kwargs = {} if c is None else {"block_m": c[0], "tiles": triton_moe.MoeTiles(*c[1:])}
        try:
            got = triton_moe.fused_moe(hidden, w13, w2, weights, ids, **kwargs)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            call = lambda kw=kwargs: triton_moe.fused_moe(hidden, w13, w2, weights, ids, **kw)  # noqa: E731
            ms = 1e3 * timed(call, 10)
            out[name] = {"ms": round(ms, 4), "graph_ms": round(graph_ms(call), 4), "rel_err": round(err, 5)}
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is a result
            out[name] = {"error": str(exc)[:200]}
    return out


def main() -> None:
    """Sweep each token count; table, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,8192")
    args = parser.parse_args()
    ceil = ceilings()
    res = {"bench": "gpu-moe-tiles", "device": torch.cuda.get_device_name(), "ceilings": ceil, "sweeps": {}}
    for n in map(int, args.tokens.split(",")):
        res["sweeps"][str(n)] = sweep(n, ceil)
        print(f"tokens {n}:")
        for name, row in res["sweeps"][str(n)].items():
            print(f"  {name:>28}: {row}")
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu-moe-tiles.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
