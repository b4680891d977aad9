"""KV capacity of a hybrid (sliding-window + global) model with per-group accounting vs every layer keeping every block,
for the same bytes: how many sequences of L tokens are held at once (issue #33's capacity benchmark).

    PYTHONPATH=shared:. python -m bench.kv.hybrid_capacity [--layers 18] [--global-every 6] [--window 512]
                                                           [--lengths 1024,8192,32768] [--layer-blocks 200000]

The bytes are `--layer-blocks` blocks of one layer (block_size tokens of K and V). All-global: a block holds every
layer, so the pool has layer_blocks / layers blocks. Per group (engine/hybrid_kv_manager.py): a page holds one block
of one group's layers, so the pool has layer_blocks / group_size pages. Sequences are admitted one after another,
each prefilled in chunks of --chunk tokens through `HybridKVCacheManager` (local blocks freed as the window moves
after every chunk) until one no longer fits; the held tokens are sequences x L. Pure accounting (no model, no
torch): it counts what the block tables hold, the part of capacity the engine's pool decides.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.hybrid_kv_manager import HybridKVCacheManager
from deepinfer.engine.kv_groups import KVGroup, kv_groups
from deepinfer.engine.request import Request


@dataclass
class _Params:
    max_tokens: int | None = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def sequences_held(groups: list[KVGroup], num_pages: int, block_size: int, length: int, chunk: int) -> int:
    """How many sequences of `length` prompt tokens the pool holds at once, each prefilled in `chunk`-token steps."""
    kv = HybridKVCacheManager(BlockPool(num_pages, enable_caching=False, enable_kv_events=False), block_size, groups)
    held = 0
    while True:
        request = Request(f"r{held}", [held % 50_000] * length, _Params())
        request.bind_block_hashing(block_size, b"capacity")
        while request.num_computed_tokens < length:
            step = min(chunk, length - request.num_computed_tokens)
            if kv.allocate_slots(request, step) is None:
                return held
            request.num_computed_tokens += step
            kv.free_out_of_window(request)
        held += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--global-every", type=int, default=6, help="every N-th layer global (Gemma 3: 6)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--layer-blocks", type=int, default=200_000,
                        help="the KV bytes, as blocks of one layer (200,000 x 16 tokens x 18 layers ~ 3.6M layer-tokens)")
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args()
    windows = [None if (i + 1) % args.global_every == 0 else args.window for i in range(args.layers)]
    groups = kv_groups(windows)
    group_size = len(groups[0].layers)
    all_global = [KVGroup(tuple(range(args.layers)))]
    rows = []
    print(f"{args.layers} layers, window {args.window}, {len(groups)} groups of {group_size} layers; "
          f"{args.layer_blocks} one-layer blocks of {args.block_size} tokens")
    print(f"{'length':>8} {'all-global seqs':>16} {'per-group seqs':>15} {'tokens all-global':>18} "
          f"{'tokens per-group':>17} {'ratio':>6}")
    for length in map(int, args.lengths.split(",")):
        plain = sequences_held(all_global, args.layer_blocks // args.layers + 1, args.block_size, length, args.chunk)
        hybrid = sequences_held(groups, args.layer_blocks // group_size + 1, args.block_size, length, args.chunk)
        ratio = hybrid / plain if plain else float("inf")
        rows.append({"length": length, "all_global_sequences": plain, "per_group_sequences": hybrid,
                     "all_global_tokens": plain * length, "per_group_tokens": hybrid * length, "ratio": ratio})
        print(f"{length:>8} {plain:>16} {hybrid:>15} {plain * length:>18} {hybrid * length:>17} {ratio:>6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
