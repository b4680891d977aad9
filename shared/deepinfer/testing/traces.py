"""Request traces in the public Mooncake JSONL format, a synthetic multi-turn generator, and the ideal hit rate.

One line per request: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]},
one hash id per `block_size` tokens of the input (the last may cover a partial block). Equal hash ids at equal
positions mean equal prefixes; `trace_tokens` turns each hash id into a fixed run of token ids, so shared hash
prefixes become shared token prefixes.

The ideal is an unlimited single cache with full-prefix reuse only: a request reuses its longest prefix of hash
ids that an earlier request's input carried, in whole blocks, never its last token (an engine computes at least
one prompt token).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> None:
    """Write a JSONL trace."""
    with Path(path).open("w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(asdict(request)) + "\n")


def read_trace(path: Path) -> list[TraceRequest]:
    """Read a JSONL trace (unknown keys ignored)."""
    requests = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            requests.append(TraceRequest(int(raw["timestamp"]), int(raw["input_length"]),
                                         int(raw["output_length"]), [int(i) for i in raw["hash_ids"]]))
    return requests


def multi_turn_trace(
    num_sessions: int,
    num_turns: int,
    block_size: int,
    first_blocks: int = 4,
    blocks_per_turn: int = 2,
    shared_blocks: int = 0,
    output_length: int = 4,
    interval_ms: int = 100,
    seed: int = 0,
) -> list[TraceRequest]:
    """Sessions whose every turn extends the previous turn's input by `blocks_per_turn` new blocks (the answer
    and the next question), turns interleaved across sessions in a seeded random order (a session's turns stay in
    order). `shared_blocks` blocks every request starts with model a system prompt."""
    rng = random.Random(seed)
    next_id = shared_blocks
    sessions: list[list[list[int]]] = []
    for _ in range(num_sessions):
        ids = list(range(shared_blocks)) + list(range(next_id, next_id + first_blocks))
        next_id += first_blocks
        turns = [ids]
        for _ in range(num_turns - 1):
            ids = ids + list(range(next_id, next_id + blocks_per_turn))
            next_id += blocks_per_turn
            turns.append(ids)
        sessions.append(turns)
    order = [s for s in range(num_sessions) for _ in range(num_turns)]
    rng.shuffle(order)
    taken = [0] * num_sessions
    requests = []
    for i, session in enumerate(order):
        ids = sessions[session][taken[session]]
        taken[session] += 1
        requests.append(TraceRequest(i * interval_ms, len(ids) * block_size, output_length, ids))
    return requests


def trace_tokens(request: TraceRequest, block_size: int, vocab_size: int, salt: int = 0) -> list[int]:
    """The prompt's token ids: block i is a fixed pseudo-random run for hash id i (ids in [1, vocab_size)),
    cut to input_length."""
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        rng = random.Random(hash_id * 1_000_003 + salt)
        tokens += [rng.randrange(1, vocab_size) for _ in range(block_size)]
    return tokens[: request.input_length]


def ideal_cached_tokens(requests: Sequence[TraceRequest], block_size: int) -> list[int]:
    """Per request, what an unlimited single cache would serve (module docstring)."""
    seen: set[tuple[int, ...]] = set()
    cached = []
    for request in requests:
        full_blocks = request.input_length // block_size
        matched = 0
        while matched < full_blocks and tuple(request.hash_ids[: matched + 1]) in seen:
            matched += 1
        cached.append(min(matched, (request.input_length - 1) // block_size) * block_size)
        for i in range(full_blocks):
            seen.add(tuple(request.hash_ids[: i + 1]))
    return cached
