"""Replay a Mooncake-format trace and print the prefix hit fraction vs the ideal, TTFT and throughput per policy.

Against a running stack (its scheduler's DEEPINFER_SCHEDULER_ROUTING_POLICY is the label you give):

    PYTHONPATH=shared:. python bench/serve/trace_replay.py --url http://127.0.0.1:8000/v1 --model M --label prefix --trace T.jsonl

Or start one `deepinfer up`-style stack per policy (store off unless --kvcache) and compare them in one run:

    PYTHONPATH=shared:. python bench/serve/trace_replay.py --start prefix,round_robin,least_loaded --prefill 2 --decode 2 --model M \\
        --sessions 8 --turns 4

Without --trace a synthetic multi-turn trace is used (deepinfer.testing.traces.multi_turn_trace). Prints a table
and one JSON line per policy; --out writes the JSON lines (e.g. under bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from deepinfer.defaults import DEFAULT_BLOCK_SIZE
from deepinfer.testing.trace_replay import ReplayResult, replay, table
from deepinfer.testing.traces import TraceRequest, multi_turn_trace, read_trace

STACK_ENV = {"DEEPINFER_GATEWAY_API_KEYS": "", "OMP_NUM_THREADS": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, help="Mooncake JSONL trace (default: a synthetic multi-turn one)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per trace hash id")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn from [1, this)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-blocks", type=int, default=4, help="blocks of a session's first turn")
    parser.add_argument("--blocks-per-turn", type=int, default=2, help="new blocks each later turn adds")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic trace's interleaving")
    parser.add_argument("--shared-blocks", type=int, default=0, help="a system prompt every request starts with")
    parser.add_argument("--output-length", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=0.0, help="0: as fast as --concurrency allows")
    parser.add_argument("--url", help="a running stack's OpenAI base URL")
    parser.add_argument("--label", default="running", help="the running stack's routing policy, for the table")
    parser.add_argument("--model", required=True, help="served model name (--url) or model to serve (--start)")
    parser.add_argument("--start", help="comma-separated policies: start one stack per policy")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--kvcache", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more stack settings")
    parser.add_argument("--out", type=Path, help="append the JSON lines here")
    return parser.parse_args(argv)


def load_trace(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is not None:
        return read_trace(args.trace)
    return multi_turn_trace(args.sessions, args.turns, args.block_size, first_blocks=args.first_blocks,
                            blocks_per_turn=args.blocks_per_turn, shared_blocks=args.shared_blocks,
                            output_length=args.output_length, seed=args.seed)


def run_started(args: argparse.Namespace, trace: list[TraceRequest], policy: str) -> ReplayResult:
    from deepinfer.up import Stack

    env = {**STACK_ENV, "DEEPINFER_SCHEDULER_ROUTING_POLICY": policy,
           "DEEPINFER_PREFILL_BLOCK_SIZE": str(args.block_size), "DEEPINFER_DECODE_BLOCK_SIZE": str(args.block_size),
           **dict(item.split("=", 1) for item in args.env)}
    with Stack(model=args.model, device=args.device, port=0, num_prefill=args.prefill, num_decode=args.decode,
               num_kvcache=args.kvcache, env_overrides=env, start_timeout_s=300) as stack:
        return asyncio.run(replay(stack.base_url, stack.model_name, trace, args.block_size, args.vocab_size,
                                  label=policy, concurrency=args.concurrency, time_scale=args.time_scale))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args)
    results: list[ReplayResult] = []
    if args.start:
        for policy in args.start.split(","):
            results.append(run_started(args, trace, policy.strip()))
    elif args.url:
        results.append(asyncio.run(replay(args.url, args.model, trace, args.block_size, args.vocab_size,
                                          label=args.label, concurrency=args.concurrency,
                                          time_scale=args.time_scale, salt=int(time.time()))))
    else:
        print("give --url (a running stack) or --start (policies to start stacks for)", file=sys.stderr)
        return 2
    print(table(results))
    meta = {"requests": len(trace), "block_size": args.block_size, "prefill": args.prefill, "decode": args.decode,
            "concurrency": args.concurrency, "env": args.env, "model": args.model,
            "trace": str(args.trace) if args.trace else (f"synthetic sessions={args.sessions} turns={args.turns} "
                                                         f"first_blocks={args.first_blocks} "
                                                         f"blocks_per_turn={args.blocks_per_turn} "
                                                         f"shared_blocks={args.shared_blocks} seed={args.seed}")}
    lines = [json.dumps({**json.loads(r.to_json()), **meta}, sort_keys=True) for r in results]
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
