"""TTFT of long prompts served from each KV tier vs recomputed, and a multi-turn workload with tiers off and on,
through the whole stack (issue 12's benchmarks).

    PYTHONPATH=shared:. python bench/kv/kv_tiers.py --quick --device cpu                       # a few minutes
    PYTHONPATH=shared:. python bench/kv/kv_tiers.py --random-model llama-8b --device cuda      # 8k and 32k prompts

Part 1, per mode (one stack each; shared/deepinfer/bench/tier_stack.py says which tiers each has):
    recompute   host tier off, store off          host    host tier on, store off
    store       host tier off, one kvcache shard, store on (over the data plane)
    store-shm   as store, the shard's RAM tier in shared memory (on CUDA: slots DMA'd to the device)
a mode may end in ":load" (the workers always load what a tier holds: the load path itself, whatever the
load-or-recompute chooser would say) or ":measured" (the chooser decides at the measured rates; the default,
--load-choice), e.g. --modes recompute,host:load,store:load,store-shm:load,store:measured,store-shm:measured
each prompt is sent once (recomputed; in `store` its blocks written behind, waited for), then filler prompts
evict it from the device pool (made small on purpose: `--pool-prompts` x the longest prompt), then each prompt
again: TTFT from that tier, the tier that served it (usage.prompt_tokens_details.cached_tokens_by_tier) and
whether the greedy text equals the first send's.
Part 2, modes tiers-off / tiers-host / tiers-on: bench/kv/kv_tiers_multiturn.py (working set `--mt-working-set` x
the pool; tiers-host: the host tier alone, so tiers-host against tiers-on is the store on vs off beside it).

TTFT = request sent -> first streamed content token (openai client). The host mode reports "unavailable" where
the workers have no host tier yet. Prints a table per part and one JSON line; writes the JSON to --out. Exits
non-zero only when a stack fails, not for a missed goal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import openai

from bench.kv import kv_tiers_multiturn as multiturn
from bench.kv.store_ttft import ttft
from bench.serve.serve import RESULTS_DIR, add_model_arguments, save_result
from deepinfer.bench import kv_workload as workload
from deepinfer.bench.tier_stack import (
    Model,
    StackPlan,
    WriteBehind,
    host_tier_available,
    load_model,
    metric_sums,
    pool_blocks,
    start_stack,
    worker_ports,
)

TIER_MODES, MULTI_TURN_MODES = ("recompute", "host", "store", "store-shm"), ("tiers-off", "tiers-host", "tiers-on")
EXPECTED_TIER = {"recompute": "recompute", "host": "host", "store": "store", "store-shm": "store"}
#: What the workers read through shared memory: blocks, of them DMA'd to the device, and fallbacks to the socket.
SHM_METRICS = ("deepinfer_worker_store_shm_blocks_total", "deepinfer_worker_store_shm_device_blocks_total",
               "deepinfer_worker_store_shm_fallbacks_total")
#: A part-1 mode may end in ":load" or ":measured": its workers' kv_load_choice (else --load-choice).
LOAD_CHOICES = ("measured", "load")
#: Defaults for the H200 run, and --quick's for a CPU run of a few minutes (the default model).
DEFAULTS = {"prompt_tokens": "8192,32768", "prompts": 3, "max_tokens": 16, "mt_context_tokens": 2048,
            "mt_turns": 4, "mt_max_tokens": 64, "mt_clients": 4, "mt_pool_tokens": 0}
QUICK = {"prompt_tokens": "1000", "prompts": 2, "max_tokens": 8, "mt_context_tokens": 256, "mt_turns": 3,
         "mt_max_tokens": 16, "mt_clients": 2, "mt_pool_tokens": 768}


@contextlib.contextmanager
def serving(args, plan: StackPlan):
    """One mode's stack, warmed up: (stack, openai client, usable device pool blocks); stopped after."""
    stack, data_dir = start_stack(plan, args.model_path, args.device, args.prefill, bool(args.random_model))
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="bench", max_retries=0, timeout=1800)
        ttft(client, stack.model_name, [{"role": "user", "content": "warm up"}], 2)
        yield stack, client, pool_blocks(stack)
    finally:
        stack.stop()
        data_dir.cleanup()


def split_mode(mode: str, default_choice: str) -> tuple[str, str]:
    """"store-shm:load" → ("store-shm", "load"); a mode without a choice takes default_choice."""
    base, _, choice = mode.partition(":")
    return base, choice or default_choice


def tier_point(args, model: Model, mode: str, groups: dict[int, tuple[list, list]], plan: StackPlan) -> dict:
    """One mode of part 1: per prompt size, first send, fillers, second send."""
    base, choice = split_mode(mode, args.load_choice)
    plan = replace(plan, mode=base, load_choice=choice)
    with serving(args, plan) as (stack, client, blocks):
        pool = blocks * model.block_size
        print(f"[{mode}] device pool: {blocks} blocks = {pool} tokens ({plan.kv_cache_bytes / 2**20:.0f} MiB)"
              + (f", host tier {plan.host_cache_bytes / 2**20:.0f} MiB" if plan.host else "")
              + (f", store {plan.store_bytes / 2**20:.0f} MiB" if plan.store else ""), flush=True)
        writes = WriteBehind(stack) if plan.store else None
        rows = [row for size, (prompts, fillers) in groups.items()
                for row in tier_rows(args, client, stack.model_name, mode, size, prompts, fillers, pool, writes,
                                     model.block_size)]
        shm = {name.removeprefix("deepinfer_worker_store_"): int(value)
               for name, value in metric_sums(worker_ports(stack), SHM_METRICS).items()} if plan.store else {}
    if shm:
        print(f"[{mode}] shared memory: {shm}", flush=True)
    return {"mode": mode, "status": "ok", "pool_blocks": blocks, "pool_tokens": pool, "rows": rows,
            "settings": vars_of(plan), **({"shared_memory": shm} if shm else {})}


def tier_rows(args, client, served: str, mode: str, size: int, prompts: list, fillers: list, pool: int,
              writes: WriteBehind | None, block_size: int) -> list[dict]:
    """One prompt size: send each prompt, evict them, send each again."""
    first, write_waits = [], []
    for index, messages in enumerate(prompts):
        first.append(ttft(client, served, messages, args.max_tokens))
        if writes is not None:  # its blocks in the store before anything can evict them
            write_waits.append(wait_for_store(args, writes, first[-1][1], block_size, f"{mode}, prompt {index}"))
    num_fillers = workload.num_fillers(pool, first[0][1]["prompt_tokens"])
    for messages in fillers[:num_fillers]:
        _, usage, _ = ttft(client, served, messages, 1)
        if writes is not None:  # the fillers' own write-behind done before the measured sends
            wait_for_store(args, writes, usage, block_size, f"{mode}, a filler")
    print(f"[{mode}] {size} tokens: {len(prompts)} prompts sent, {num_fillers} fillers evicted them", flush=True)
    rows = []
    for index, (messages, (t_first, u_first, text_first)) in enumerate(zip(prompts, first, strict=True)):
        t_again, u_again, text_again = ttft(client, served, messages, args.max_tokens)
        tier = workload.served_tier(u_again["by_tier"], u_again["prompt_tokens"])
        expected = EXPECTED_TIER[split_mode(mode, "")[0]]
        rows.append({"size": size, "prompt_tokens": u_again["prompt_tokens"], "ttft_first_s": round(t_first, 4),
                     "ttft_again_s": round(t_again, 4), "by_tier_first": u_first["by_tier"],
                     "by_tier_again": u_again["by_tier"], "served_by": tier, "tier_ok": tier == expected,
                     "same_text": text_first == text_again, "num_fillers": num_fillers,
                     **({"store_write": write_waits[index]} if write_waits else {})})
    return rows


def wait_for_store(args, writes: WriteBehind, usage: dict, block_size: int, what: str) -> dict:
    """Until the full blocks of a prompt just sent are in the store (write-behind); says so when not all came."""
    waited = writes.wait((usage["prompt_tokens"] - 1) // block_size, args.write_timeout_s)
    if not waited["complete"]:
        print(f"[{what}] only {waited['written']} of {waited['expected']} blocks reached the store in "
              f"{waited['waited_s']} s ({waited['dropped']} dropped)", flush=True)
    return waited


def multi_turn_point(args, model: Model, mode: str, plan: StackPlan, turns_plan) -> dict:
    """One mode of part 2."""
    with serving(args, plan) as (stack, client, blocks):
        print(f"[{mode}] device pool: {blocks} blocks = {blocks * model.block_size} tokens; "
              f"{turns_plan.num_conversations} conversations x {turns_plan.turns} turns, "
              f"{args.mt_clients} clients", flush=True)
        turns, wall_s, errors = multiturn.run_clients(client, stack.model_name, turns_plan, args.mt_clients,
                                                      args.mt_max_tokens)
    if errors:
        raise RuntimeError("; ".join(errors))
    point = multiturn.summarize(mode, turns, wall_s)
    return point | {"pool_blocks": blocks, "host_tier": plan.host, "store": plan.store, "settings": vars_of(plan)}


def vars_of(plan: StackPlan) -> dict:
    return {"kv_cache_bytes": plan.kv_cache_bytes, "max_model_len": plan.max_model_len,
            "host_cache_bytes": plan.host_cache_bytes if plan.host else 0,
            "store_bytes": plan.store_bytes if plan.store else 0, "store_load_timeout_s": plan.load_timeout_s,
            "load_choice": plan.load_choice, "shm": plan.mode == "store-shm", "env": list(plan.extra_env)}


def run_part(modes: list[str], point) -> tuple[list[dict], bool]:
    """Each mode's point; a mode whose stack fails is recorded (and makes the run fail), the others still run."""
    points, failed = [], False
    for mode in modes:
        if mode.partition(":")[0] in ("host",) and not host_tier_available():
            points.append({"mode": mode, "status": "unavailable",
                           "reason": "the workers have no kv_host_cache_bytes setting (host tier not in this tree)"})
            print(f"[{mode}] unavailable: no host tier in this tree", flush=True)
            continue
        try:
            points.append(point(mode))
        except Exception as exc:
            failed = True
            print(f"[{mode}] the stack failed: {exc!r}", file=sys.stderr, flush=True)
            points.append({"mode": mode, "status": "failed", "error": repr(exc)})
    return points, failed


def tier_groups(args, model: Model, sizes: list[int], pool: int) -> tuple[dict[int, tuple[list, list]], int]:
    """Per prompt size: the measured prompts and the fillers that evict them from a pool of `pool` tokens; and
    the tokens the store holds for one size (its prompts and fillers)."""
    groups, store_tokens = {}, 0
    for index, size in enumerate(sizes):
        facts = workload.num_facts_for(size, model.count_tokens, 1000 * index)  # sized at the prompts' own index
        filler_offset = workload.FILLER_OFFSET + 1000 * index
        filler_facts = workload.num_facts_for(size, model.count_tokens, filler_offset)
        fillers = workload.long_prompts(workload.num_fillers(pool, int(0.9 * size)) + 1, filler_facts, filler_offset)
        groups[size] = (workload.long_prompts(args.prompts, facts, 1000 * index), fillers)
        store_tokens = max(store_tokens, (args.prompts + workload.num_fillers(pool, size)) * size)
    return groups, store_tokens


def multi_turn_plan(args, model: Model, pool: int) -> tuple[workload.MultiTurnPlan, int, int]:
    """Part 2's conversations, its device pool (tokens; at least one whole conversation) and max_model_len."""
    mt_pool = args.mt_pool_tokens or pool
    context_facts = workload.num_facts_for(args.mt_context_tokens, model.count_tokens, workload.CONVERSATION_OFFSET)
    turn_tokens = model.count_tokens(workload.user_message(99, 9)) + args.mt_max_tokens + 12
    # An answer can come back as more tokens than were generated (random weights: retokenized noise).
    slack = args.mt_turns * args.mt_max_tokens
    while True:
        turns = workload.plan_multi_turn(mt_pool, args.mt_context_tokens, args.mt_turns, turn_tokens,
                                         context_facts, args.mt_working_set)
        mt_len = workload.max_model_len(turns.final_tokens + slack, args.mt_max_tokens, model.block_size)
        if mt_pool >= mt_len + model.block_size:
            return turns, mt_pool, mt_len
        mt_pool = mt_len + model.block_size


def build_plans(args, model: Model) -> dict:
    """Prompts, fillers, the multi-turn plan and each part's stack settings, from the options and the model."""
    sizes = sorted(int(s) for s in args.prompt_tokens.split(","))
    longest, bs, bpt = sizes[-1], model.block_size, model.bytes_per_token
    kv_bytes = args.kv_cache_bytes or workload.pool_bytes(int(args.pool_prompts * longest), bpt, bs)
    groups, store_tokens = tier_groups(args, model, sizes, workload.pool_tokens_of(kv_bytes, bpt, bs))
    turns, mt_pool, mt_len = multi_turn_plan(args, model, workload.pool_tokens_of(kv_bytes, bpt, bs))
    store_tokens = max(store_tokens, turns.working_set_tokens)
    host_bytes = args.host_cache_bytes or workload.pool_bytes(
        int((args.prompts + args.pool_prompts + 1) * longest), bpt, bs)
    # The shard holds one size's prompts and fillers at once (older ones may go): RAM, and the disk beneath it.
    common = {"host_cache_bytes": host_bytes, "store_bytes": int(1.1 * store_tokens * bpt) + (64 << 20),
              "load_timeout_s": args.store_load_timeout_s, "extra_env": tuple(args.env),
              "shm_slot_bytes": -(-bpt * bs // 4096) * 4096}
    part1_len = workload.max_model_len(longest, args.max_tokens, bs)
    for length in (part1_len, mt_len):
        if length > model.max_position_embeddings:
            sys.exit(f"a request of {length} tokens exceeds the model's max_position_embeddings="
                     f"{model.max_position_embeddings}")
    return {
        "groups": groups, "turns": turns,
        "tiers": StackPlan("tiers", kv_bytes, part1_len, **common),
        "multi_turn": StackPlan("multi-turn", workload.pool_bytes(mt_pool, bpt, bs), mt_len, **common),
    }


def describe(plans: dict) -> None:
    """The sizes the run will use, before any stack starts."""
    tiers, mt, turns = plans["tiers"], plans["multi_turn"], plans["turns"]
    print(f"part 1: device pool {tiers.kv_cache_bytes / 2**20:.0f} MiB, max_model_len {tiers.max_model_len}; "
          + "; ".join(f"{size} tokens: {len(p)} prompts, up to {len(f)} fillers"
                      for size, (p, f) in plans["groups"].items()), flush=True)
    print(f"part 2: device pool {mt.kv_cache_bytes / 2**20:.0f} MiB, max_model_len {mt.max_model_len}; "
          f"{turns.num_conversations} conversations x {turns.turns} turns, ~{turns.final_tokens} tokens at the "
          f"last turn", flush=True)
    print(f"host tier {tiers.host_cache_bytes / 2**20:.0f} MiB (where on), store RAM and disk "
          f"{tiers.store_bytes / 2**20:.0f} MiB (where on)", flush=True)


def main() -> None:
    args = parse_args()
    from deepinfer.up.devices import count_nvidia_gpus

    device = args.device if args.device != "auto" else ("cuda" if count_nvidia_gpus() else "cpu")
    args.model_path = args.model
    if args.random_model:
        from deepinfer.testing.random_model import write_random_model

        args.model_path = str(write_random_model(args.random_model, args.cache_dir))
    model = load_model(args.model_path, device)
    plans = build_plans(args, model)
    modes = args.modes.split(",")
    print(f"model {args.random_model or args.model} on {device}: {model.bytes_per_token} KV bytes/token, "
          f"host tier {'available' if host_tier_available() else 'not in this tree'}", flush=True)
    describe(plans)
    if args.plan_only:
        return
    tiers, failed_1 = run_part([m for m in modes if split_mode(m, "")[0] in TIER_MODES], lambda mode: tier_point(
        args, model, mode, plans["groups"], plans["tiers"]))
    turns, failed_2 = run_part([m for m in modes if m in MULTI_TURN_MODES], lambda mode: multi_turn_point(
        args, model, mode, replace(plans["multi_turn"], mode=mode), plans["turns"]))
    report(args, device, model, tiers, turns, plans["turns"])
    sys.exit(1 if failed_1 or failed_2 else 0)


def tier_summary(points: list[dict]) -> list[dict]:
    """Per mode and prompt size: median TTFTs, and whether every prompt came from the expected tier unchanged."""
    summary = []
    recompute = {}
    for point in points:
        for size in sorted({r["size"] for r in point.get("rows", [])}):
            rows = [r for r in point["rows"] if r["size"] == size]
            line = {"mode": point["mode"], "size": size, "prompt_tokens": rows[0]["prompt_tokens"],
                    "ttft_first_s": statistics.median(r["ttft_first_s"] for r in rows),
                    "ttft_again_s": statistics.median(r["ttft_again_s"] for r in rows),
                    "served_by": sorted({r["served_by"] for r in rows}),
                    "tier_ok": all(r["tier_ok"] for r in rows), "same_text": all(r["same_text"] for r in rows),
                    "store_writes_complete": all(r["store_write"]["complete"] for r in rows)
                    if "store_write" in rows[0] else None}
            if split_mode(point["mode"], "")[0] == "recompute":
                recompute[size] = line["ttft_again_s"]
            summary.append(line)
    for line in summary:  # against recomputing in the same run (else this mode's own first sends)
        base = recompute.get(line["size"], line["ttft_first_s"])
        line["speedup_vs_recompute"] = round(base / line["ttft_again_s"], 2) if line["ttft_again_s"] else None
    return summary


def print_tiers(args, summary: list[dict], points: list[dict]) -> None:
    """Part 1's table: one row per prompt size and mode."""
    print(f"\nTTFT from each tier: {args.random_model or args.model}, median of {args.prompts} prompts")
    print(f"{'size':>6} {'mode':>18} {'tokens':>7} {'TTFT 1st':>9} {'TTFT again':>11} {'speedup':>8} "
          f"{'served by':>12} {'same text':>10} {'store writes':>13}")
    for s in summary:
        print(f"{s['size']:>6} {s['mode']:>18} {s['prompt_tokens']:>7} {s['ttft_first_s']:>8.3f}s "
              f"{s['ttft_again_s']:>10.3f}s {s['speedup_vs_recompute']:>7}x {','.join(s['served_by']):>12} "
              f"{str(s['same_text']):>10} {str(s['store_writes_complete']):>13}")
    for point in points:
        if point["status"] != "ok":
            print(f"{point['mode']}: {point['status']} ({point.get('reason') or point.get('error')})")


def report(args, device: str, model: Model, tiers: list[dict], turns: list[dict], plan) -> None:
    """Tables, the JSON line, the JSON file."""
    summary = tier_summary(tiers)
    if tiers:
        print_tiers(args, summary, tiers)
    if turns:
        print(f"\nmulti-turn: {plan.num_conversations} conversations x {plan.turns} turns, working set ~"
              f"{plan.working_set_tokens} tokens ({args.mt_working_set}x the pool), {args.mt_clients} clients")
        multiturn.print_table([p | {"error": p.get("error") or p.get("reason")} if p.get("status") else p
                               for p in turns])
    result = {"bench": "kv_tiers", "model": args.random_model or args.model, "device": device,
              "date": time.strftime("%Y-%m-%d"), "kv_bytes_per_token": model.bytes_per_token,
              "host_tier_available": host_tier_available(), "tiers_summary": summary, "tiers": tiers,
              "multi_turn_plan": vars(plan) | {"working_set_tokens": plan.working_set_tokens},
              "multi_turn": turns, "multi_turn_on_over_off": multiturn.tiers_on_over_off(turns), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    save_result(result, args.out or RESULTS_DIR / f"kv-tiers-{device}-{result['date']}.json")


def parse_args() -> argparse.Namespace:
    """The command line; unset sizes come from DEFAULTS, or QUICK with --quick."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes: a CPU run of a few minutes")
    parser.add_argument("--modes", default=",".join(TIER_MODES + MULTI_TURN_MODES))
    parser.add_argument("--load-choice", choices=LOAD_CHOICES, default="measured",
                        help="the workers' kv_load_choice for part-1 modes without ':load' / ':measured'")
    parser.add_argument("--prompt-tokens", help="comma-separated prompt sizes (default 8192,32768)")
    parser.add_argument("--prompts", type=int, help="prompts per size (default 3)")
    parser.add_argument("--max-tokens", type=int, help="answer tokens of a measured prompt (default 16)")
    parser.add_argument("--kv-cache-bytes", type=int, default=0,
                        help="the device pool (default: --pool-prompts x the longest prompt)")
    parser.add_argument("--pool-prompts", type=float, default=1.5, help="the default pool, in longest prompts")
    parser.add_argument("--host-cache-bytes", type=int, default=0,
                        help="the host tier (default: room for every prompt of a size, and the fillers past the pool)")
    parser.add_argument("--store-load-timeout-s", type=float, default=60.0,
                        help="the workers' kv_store_load_timeout_s (a 32k prompt of the 8B shape is 4 GiB)")
    parser.add_argument("--write-timeout-s", type=float, default=300.0,
                        help="longest wait for a prompt's write-behind before evicting it")
    parser.add_argument("--mt-context-tokens", type=int, help="a conversation's first prompt (default 2048)")
    parser.add_argument("--mt-turns", type=int, help="turns per conversation (default 4)")
    parser.add_argument("--mt-max-tokens", type=int, help="answer tokens per turn (default 64)")
    parser.add_argument("--mt-clients", type=int, help="concurrent clients (default 4)")
    parser.add_argument("--mt-pool-tokens", type=int, help="part 2's device pool (default: part 1's)")
    parser.add_argument("--mt-working-set", type=float, default=4.0, help="the working set, in device pools")
    parser.add_argument("--prefill", type=int, default=0,
                        help="prefill workers (default 0: the decode worker computes prompts, as on one GPU)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the stack's services (last: overrides the bench's)")
    parser.add_argument("--plan-only", action="store_true", help="print the sizes the run would use, and stop")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/kv-tiers-*.json)")
    args = parser.parse_args()
    modes = [split_mode(m, "measured") for m in args.modes.split(",")]
    unknown = {f"{base}:{choice}" for base, choice in modes
               if base not in TIER_MODES + MULTI_TURN_MODES or choice not in LOAD_CHOICES}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(TIER_MODES + MULTI_TURN_MODES)}")
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "kv-tiers.json"
    return args


if __name__ == "__main__":
    main()
