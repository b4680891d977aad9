"""Part 2 of bench/kv/kv_tiers.py: a multi-turn workload whose working set is several times the device pool.

K conversations, each turn the previous request + its answer + a new user message, visited round-robin
(every conversation's turn 1, then every turn 2, ...) by a few concurrent clients; a conversation's next turn
waits for its previous answer. With tiers off, a conversation's blocks are evicted before its next turn comes
round (the working set is larger than the pool) and every turn recomputes its whole prompt; with tiers on, they
come back from the host tier or the store.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai

from bench.kv.store_ttft import ttft
from bench.serve.serve import percentile
from deepinfer.bench.kv_workload import MultiTurnPlan, first_turn, next_turn, round_robin, tier_totals


@dataclass
class Turn:
    """One request's result."""

    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    by_tier: dict[str, int] | None


@dataclass
class Conversations:
    """The conversations' current requests and which turns are done, shared by the client threads."""

    plan: MultiTurnPlan
    order: list[tuple[int, int]]
    messages: dict[int, list] = field(default_factory=dict)
    done: dict[tuple[int, int], threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    results: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def take(self) -> tuple[int, int] | None:
        with self.lock:
            return self.order.pop(0) if self.order and not self.errors else None


def run_clients(client: openai.OpenAI, model: str, plan: MultiTurnPlan, num_clients: int,
                max_tokens: int) -> tuple[list[Turn], float, list[str]]:
    """Every turn of every conversation through `num_clients` threads: (results, wall seconds, errors)."""
    state = Conversations(plan, round_robin(plan.num_conversations, plan.turns))
    state.messages = {c: first_turn(c, plan.context_facts) for c in range(plan.num_conversations)}
    state.done = {(c, t): threading.Event() for c, t in state.order}
    threads = [threading.Thread(target=_client, args=(client, model, state, max_tokens), daemon=True)
               for _ in range(num_clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return state.results, time.perf_counter() - started, state.errors


def _client(client: openai.OpenAI, model: str, state: Conversations, max_tokens: int) -> None:
    while (item := state.take()) is not None:
        conversation, turn = item
        if turn > 0:
            state.done[(conversation, turn - 1)].wait()
        messages = state.messages[conversation]
        try:
            seconds, usage, text = ttft(client, model, messages, max_tokens)
        except Exception as exc:  # the stack failed: stop every client, report it
            with state.lock:
                state.errors.append(f"conversation {conversation} turn {turn}: {exc!r}")
            state.done[item].set()
            return
        with state.lock:
            state.results.append(Turn(conversation, turn, seconds, usage["prompt_tokens"],
                                      usage["completion_tokens"], usage["by_tier"]))
            state.messages[conversation] = next_turn(messages, text, conversation, turn + 1)
        state.done[item].set()


def summarize(mode: str, turns: list[Turn], wall_s: float) -> dict:
    """Throughput, TTFT and where the prompt tokens came from, for one mode."""
    ttft_ms = [t.ttft_s * 1000 for t in turns]
    prompt_tokens = sum(t.prompt_tokens for t in turns)
    by_tier = tier_totals(t.by_tier for t in turns)
    return {
        "mode": mode, "requests": len(turns), "wall_s": round(wall_s, 2),
        "output_tok_s": round(sum(t.completion_tokens for t in turns) / wall_s, 2) if wall_s else None,
        "ttft_ms_p50": round(percentile(ttft_ms, 50), 1), "ttft_ms_p99": round(percentile(ttft_ms, 99), 1),
        "prompt_tokens": prompt_tokens, "cached_tokens_by_tier": by_tier,
        "cached_fraction": round(sum(by_tier.values()) / prompt_tokens, 4) if prompt_tokens else None,
    }


def tiers_on_over_off(points: list[dict], off_mode: str = "tiers-off") -> float | None:
    """Output tok/s with tiers on over `off_mode` (tiers-off, or tiers-host: the store's share), when both ran."""
    rates = {p["mode"]: p.get("output_tok_s") for p in points}
    on, off = rates.get("tiers-on"), rates.get(off_mode)
    return round(on / off, 3) if on and off else None


def print_table(points: list[dict]) -> None:
    """One row per mode, and the throughput ratio."""
    print(f"\n{'mode':>10} {'requests':>9} {'out tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} "
          f"{'prompt tok':>11} {'cached':>7}  by tier")
    for p in points:
        if p.get("error"):
            print(f"{p['mode']:>10}  failed: {p['error']}")
            continue
        print(f"{p['mode']:>10} {p['requests']:>9} {p['output_tok_s']:>10} {p['ttft_ms_p50']:>8}ms "
              f"{p['ttft_ms_p99']:>8}ms {p['prompt_tokens']:>11} {p['cached_fraction']:>7.1%}  "
              f"{p['cached_tokens_by_tier']}")
    if (ratio := tiers_on_over_off(points)) is not None:
        print(f"output tok/s, tiers on / tiers off: {ratio}x")
    if (ratio := tiers_on_over_off(points, "tiers-host")) is not None:
        print(f"output tok/s, tiers on / the host tier alone (the store on / off beside it): {ratio}x")
