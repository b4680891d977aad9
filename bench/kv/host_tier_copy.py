"""Host-tier copy GB/s on a GPU: HostTier's load (pinned slots → device staging → one scatter of every layer) and
offload (one gather of every layer → staging → pinned slots) of batches of blocks, beside a pinned `copy_` of the
same bytes as one tensor, in the same run. Prints "no CUDA" and exits 0 without one.

    PYTHONPATH=shared:. python bench/kv/host_tier_copy.py [--blocks 16 64 256] [--reps 10] [--ops torch] [--out NAME.json]

--ops torch times the torch twins of the block copies (one index_select / index_copy_ per layer, the copies before
the Triton block copies) instead of the Triton kernels.

Shape: llama-8b's KV (32 layers × K,V × 16 tokens × 8 KV heads × 128 × bf16 = 2 MiB per block). Device blocks and
host slots are drawn at random (scattered, as in a running pool). Each figure is the median of --reps, timed from
issue to the copy's event done. Issue goal: load ≥ 80% of the pinned copy. Saves the JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def _timed(fn, reps: int) -> float:
    """Median seconds of fn() (which returns an event or None and leaves work on the GPU), synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        event = fn()
        (event.synchronize() if event is not None else torch.cuda.synchronize())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _no_event(_: torch.Tensor) -> None:
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device-blocks", type=int, default=1024)
    parser.add_argument("--ops", choices=["triton", "torch"], default="triton",
                        help="the block copies: Triton kernels (one launch) or the torch twins (per layer)")
    parser.add_argument("--out", default=None, help="file name under bench/results/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA")
        return 0
    from deepinfer.engine.block_pool import BlockPool
    from deepinfer.engine.host_tier import HostTier
    from deepinfer.kernels import get_ops

    device = torch.device("cuda")
    shape = (2, args.device_blocks, 16, 8, 128)
    kv_caches = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    num_slots = max(args.blocks) * 2
    ops = get_ops("cuda" if args.ops == "triton" else "cpu")  # "cpu": the torch twins (they run on any device)
    tier = HostTier(kv_caches, num_slots, BlockPool(args.device_blocks, enable_kv_events=False), ops=ops)
    nbytes = tier.block_nbytes
    rng = random.Random(0)
    rows = [_row(tier, n, args.device_blocks, num_slots, args.reps, rng) for n in args.blocks]
    _check_roundtrip(tier, kv_caches)
    print(f"{'blocks':>7} {'MiB':>6} {'load':>8} {'h2d':>8} {'ratio':>6} {'offload':>8} {'d2h':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['bytes'] >> 20:>6} {r['load GB/s']:>8} {r['pinned h2d GB/s']:>8} "
              f"{r['load / pinned h2d']:>6} {r['offload GB/s']:>8} {r['pinned d2h GB/s']:>8} "
              f"{r['offload / pinned d2h']:>6}")
    result = {"bench": "host_tier_copy", "device": torch.cuda.get_device_name(), "block_nbytes": nbytes,
              "layers": args.layers, "reps": args.reps, "block_copies": tier.ops.implementations()["gather_blocks"],
              "rows": rows}
    print(json.dumps(result))
    if args.out:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _row(tier, n: int, device_blocks: int, num_slots: int, reps: int, rng: random.Random) -> dict:
    """One batch size: the four copies of n blocks, GB/s and the ratios."""
    block_ids = rng.sample(range(1, device_blocks), n)
    slots = rng.sample(range(num_slots), n)
    nbytes = tier.block_nbytes
    pinned = torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty((n, nbytes), dtype=torch.uint8, device=tier.device)
    seconds = {
        "offload": _timed(lambda: tier.copy_to_host(block_ids, slots), reps),
        "load": _timed(lambda: tier.copy_to_device(slots, block_ids), reps),
        "pinned d2h": _timed(lambda: _no_event(pinned.copy_(on_device, non_blocking=True)), reps),
        "pinned h2d": _timed(lambda: _no_event(on_device.copy_(pinned, non_blocking=True)), reps),
    }
    size = n * nbytes
    gbps = {k: size / s / 1e9 for k, s in seconds.items()}
    return {"blocks": n, "bytes": size, **{f"{k} GB/s": round(v, 2) for k, v in gbps.items()},
            "load / pinned h2d": round(gbps["load"] / gbps["pinned h2d"], 3),
            "offload / pinned d2h": round(gbps["offload"] / gbps["pinned d2h"], 3)}


def _check_roundtrip(tier, kv_caches) -> None:
    """The bench's copies move the right bytes: offload two blocks, load them into two others, compare."""
    from deepinfer.engine.kv_transfer import export_blocks

    tier.copy_to_host([1, 2], [0, 1]).synchronize()
    assert tier.host[0].cpu().numpy().tobytes() == export_blocks(kv_caches, [1])[0]
    tier.copy_to_device([0, 1], [3, 4]).synchronize()
    assert all(torch.equal(kv[:, [1, 2]], kv[:, [3, 4]]) for kv in kv_caches)


if __name__ == "__main__":
    sys.exit(main())
