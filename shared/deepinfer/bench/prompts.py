"""The text a benchmark sends, made deterministically from seeds and ids so two runs (or two servers) see the
same prompts. Words are common English words, about one token each under any BPE tokenizer, so a length in words
stands for a length in tokens.

- `make_prompts`: independent prompts of a fixed length (the concurrency and rate sweeps).
- `trace_prompt`: a Mooncake trace line's prompt. Each hash id is one block of `block_size` words, drawn from a
  generator seeded by the hash id alone, so equal hash ids at the front of two lines give equal text prefixes
  (the prefix sharing the trace records); the last block is cut to the line's `input_length`.
- `first_turn` / `next_turn`: a conversation, each turn the whole history, the model's answer and a new user
  message, so turn t+1's prompt starts with turn t's prompt followed by its answer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: Common English words, one string (split once): prompts of plain text any tokenizer handles.
_WORDS = (
    "the of and to in is it that for on with as was by at be this from have or are an not but they his her"
    " one all were we when there can which their said if do will each about how up out them then she many"
    " some so these would other into has more two like him see time could no make than first been its who now"
    " people my made over did down only way find use may water long little very after words called just where"
    " most know"
)
WORDS = tuple(_WORDS.split(" "))

#: Tokens per hash id in the published Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512


def words(seed: str | int, num_words: int) -> list[str]:
    """`num_words` common words drawn by a generator seeded with `seed` (str seeds are stable across runs)."""
    rng = random.Random(seed)
    return [rng.choice(WORDS) for _ in range(num_words)]


def make_prompts(num_prompts: int, num_words: int, seed: int | str = 0) -> list[str]:
    """`num_prompts` texts of `num_words` common words each, the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(num_words)) for _ in range(num_prompts)]


def trace_prompt(
    hash_ids: Sequence[int],
    input_length: int,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    line: int = 0,
    salt: str = "",
) -> str:
    """A trace line's prompt of `input_length` words: block i is hash id i's text (module docstring), under `salt`
    (another salt, other text for the same ids). A line with fewer hash ids than its length needs ends in words of
    its own (seeded by `line`), shared with no other."""
    out: list[str] = []
    for hash_id in hash_ids:
        if len(out) >= input_length:
            break
        out += words(f"block:{salt}:{hash_id}", block_size)[: input_length - len(out)]
    if len(out) < input_length:
        out += words(f"line:{salt}:{line}", input_length - len(out))
    return " ".join(out)


def user_message(seed: int | str, conversation: int, turn: int, num_words: int) -> str:
    """The user's message of one turn of one conversation."""
    return " ".join(words(f"conversation:{seed}:{conversation}:{turn}", num_words))


def first_turn(message: str) -> str:
    """The prompt of a conversation's first turn."""
    return f"User: {message}\nAssistant:"


def next_turn(prompt: str, answer: str, message: str) -> str:
    """The next turn's prompt: the last prompt, its answer, and the new user message."""
    return f"{prompt}{answer}\n{first_turn(message)}"
