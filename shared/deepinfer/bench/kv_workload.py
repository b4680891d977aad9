"""The workloads of bench/kv/kv_tiers.py, as pure functions: long prompts of a token count, the device pool sized
from them, the fillers that evict them, and a multi-turn plan whose working set is a multiple of the pool.

Prompts are `prompt`'s, also bench/kv/store_ttft.py's (a system message of numbered facts, then a question): distinct from their first
block on, so one prompt never shares a cached block with another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

#: Chat-template and question tokens around the facts (the default model's template; an estimate).
TEMPLATE_TOKENS = 24
#: Offsets of the prompt indices per use, so measured prompts, fillers and conversations never share a block.
FILLER_OFFSET, CONVERSATION_OFFSET = 10_000, 20_000

CountTokens = Callable[[str], int]
Messages = list[dict[str, str]]


def prompt(index: int, num_facts: int) -> Messages:
    """A system message of `num_facts` numbered facts of line `index`, then a question about one of them."""
    facts = " ".join(f"Fact {index}.{i}: station {i} on line {index} opens at {6 + i % 5}:{i % 60:02d}."
                     for i in range(num_facts))
    return [{"role": "system", "content": facts}, {"role": "user", "content": "When does station 42 open?"}]


def num_facts_for(target_tokens: int, count_tokens: CountTokens, index: int = 0) -> int:
    """Facts whose system message (with the template around it) comes to about `target_tokens`, at most."""
    goal = max(1, target_tokens - TEMPLATE_TOKENS)
    facts = max(1, goal // 24)
    for _ in range(8):  # tokens per fact grow slowly with the digits: a few corrections converge
        tokens = count_tokens(prompt(index, facts)[0]["content"])
        per_fact = tokens / facts
        if tokens > goal:
            facts = max(1, facts - math.ceil((tokens - goal) / per_fact))
        elif goal - tokens >= per_fact:
            facts += math.floor((goal - tokens) / per_fact)
        else:
            break
    while facts > 1 and count_tokens(prompt(index, facts)[0]["content"]) > goal:
        facts -= 1
    return facts


def long_prompts(count: int, num_facts: int, offset: int = 0) -> list[Messages]:
    """`count` distinct long prompts."""
    return [prompt(offset + i, num_facts) for i in range(count)]


def pool_bytes(pool_tokens: int, bytes_per_token: int, block_size: int) -> int:
    """KV bytes of a device pool holding `pool_tokens` (whole blocks, plus the reserved block 0)."""
    return (math.ceil(pool_tokens / block_size) + 1) * block_size * bytes_per_token


def pool_tokens_of(kv_cache_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens a pool of `kv_cache_bytes` holds (block 0 is reserved)."""
    return (kv_cache_bytes // (bytes_per_token * block_size) - 1) * block_size


def num_fillers(pool_tokens: int, filler_tokens: int, margin: float = 1.25) -> int:
    """Prompts of `filler_tokens` that, sent one after another, allocate `margin` x the pool: every block cached
    before them is evicted (LRU) by the time they are done."""
    return max(1, math.ceil(margin * pool_tokens / filler_tokens))


def max_model_len(longest_tokens: int, max_tokens: int, block_size: int) -> int:
    """A context limit that fits the longest request with its answer (whole blocks, some slack for the
    template estimate)."""
    return math.ceil((longest_tokens + max_tokens + 64) / block_size) * block_size


@dataclass(frozen=True)
class MultiTurnPlan:
    """K conversations of `turns` turns; each turn adds a user message and the previous answer."""

    num_conversations: int
    turns: int
    context_facts: int
    final_tokens: int  # one conversation's prompt at its last turn (estimate)

    @property
    def working_set_tokens(self) -> int:
        return self.num_conversations * self.final_tokens


def plan_multi_turn(pool_tokens: int, context_tokens: int, turns: int, turn_tokens: int, context_facts: int,
                    working_set_ratio: float = 4.0) -> MultiTurnPlan:
    """K chosen so that K conversations at their last turn hold `working_set_ratio` x the device pool.
    `turn_tokens`: what one turn adds (user message, answer, template)."""
    final = context_tokens + (turns - 1) * turn_tokens
    conversations = max(1, math.ceil(working_set_ratio * pool_tokens / final))
    return MultiTurnPlan(conversations, turns, context_facts, final)


def user_message(conversation: int, turn: int) -> str:
    """The user's message of a turn (a question about the facts, different every turn)."""
    return (f"Question {turn + 1} of conversation {conversation}: which stations on line "
            f"{CONVERSATION_OFFSET + conversation} open at {6 + turn % 5}:{(7 * turn) % 60:02d}? List them.")


def first_turn(conversation: int, context_facts: int) -> Messages:
    """A conversation's first request: its own facts, then the first question."""
    system = prompt(CONVERSATION_OFFSET + conversation, context_facts)[0]
    return [system, {"role": "user", "content": user_message(conversation, 0)}]


def next_turn(messages: Messages, answer: str, conversation: int, turn: int) -> Messages:
    """The request of `turn` (>= 1): the previous request, its answer, and a new user message."""
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": user_message(conversation, turn)}]


def round_robin(num_conversations: int, turns: int) -> list[tuple[int, int]]:
    """The visiting order: every conversation's turn 0, then every turn 1, ... (conversation, turn)."""
    return [(c, t) for t in range(turns) for c in range(num_conversations)]


def tier_totals(by_tier: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """Sum of cached_tokens_by_tier over requests (a request without the field counts nothing)."""
    totals: dict[str, int] = {}
    for tiers in by_tier:
        for tier, tokens in (tiers or {}).items():
            totals[tier] = totals.get(tier, 0) + tokens
    return totals


def served_tier(by_tier: Mapping[str, int] | None, prompt_tokens: int, min_fraction: float = 0.5) -> str:
    """The tier that served most of a prompt's cached tokens, or "recompute" when cached tokens from all
    tiers together are under `min_fraction` of the prompt."""
    tiers = {tier: n for tier, n in (by_tier or {}).items() if n > 0}
    if sum(tiers.values()) < min_fraction * prompt_tokens:
        return "recompute"
    return max(tiers, key=lambda tier: tiers[tier])
