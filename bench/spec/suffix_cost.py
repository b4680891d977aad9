"""What suffix decoding's drafter costs on the host, beside n-gram lookup: the first propose of a request (its
prompt inserted), each later propose (one token appended), tree nodes per token, and a retired request's insertion
into and removal from the global tree, and the bytes a held token costs. Synthetic token streams (Pareto-distributed ids over 5,000, a fifth of
them copies of 3-20 earlier tokens), no model. Figures: docs/speculative.md ("Suffix decoding", Cost).

    PYTHONPATH=shared:. python bench/spec/suffix_cost.py [--prompt-lens 200,2000,8000] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from deepinfer.engine.drafter import propose_ngram
from deepinfer.engine.request import Request
from deepinfer.engine.suffix_drafter import SuffixDrafter
from deepinfer.engine.suffix_tree import SuffixTree


def token_stream(rng: random.Random, num_tokens: int) -> list[int]:
    """Ids with text-like repeats: mostly fresh (heavy-tailed), a fifth copies of an earlier run of tokens."""
    out: list[int] = []
    while len(out) < num_tokens:
        if out and rng.random() < 0.2:
            start = rng.randrange(len(out))
            out += out[start : start + rng.randint(3, 20)]
        else:
            out.append(int(rng.paretovariate(1.0) * 10) % 5000)
    return out[:num_tokens]


def per_request(rng: random.Random, prompt_len: int, num_steps: int) -> str:
    drafter = SuffixDrafter()
    request = Request("r", token_stream(rng, prompt_len), sampling_params=None)
    started = time.perf_counter()
    drafter.propose(request, 8)
    first_ms = (time.perf_counter() - started) * 1e3
    output = token_stream(rng, num_steps)
    started = time.perf_counter()
    for token_id in output:
        request.append_output_token_ids([token_id])
        drafter.propose(request, 8)
    step_ms = (time.perf_counter() - started) * 1e3 / num_steps
    started = time.perf_counter()
    for _ in range(100):
        propose_ngram(request.all_token_ids, 2, 5, 8)
    ngram_ms = (time.perf_counter() - started) * 10
    tree = drafter.request_tree("r")
    return (f"prompt {prompt_len}: first propose {first_ms:.1f} ms, then {step_ms:.3f} ms a step (n-gram "
            f"{ngram_ms:.3f} ms); {tree.num_nodes() / request.num_tokens:.1f} nodes a token")


def global_tree(rng: random.Random, num_requests: int, output_len: int) -> str:
    tree = SuffixTree(24)
    started = time.perf_counter()
    for seq_id in range(num_requests):
        tree.add(seq_id, token_stream(rng, output_len))
    add_ms = (time.perf_counter() - started) * 1e3 / num_requests
    started = time.perf_counter()
    for seq_id in range(num_requests // 10):
        tree.remove(seq_id)
    remove_ms = (time.perf_counter() - started) * 1e3 / (num_requests // 10)
    return (f"global tree, {num_requests} x {output_len} tokens: {add_ms:.1f} ms to add one, {remove_ms:.2f} ms to "
            f"remove one, {tree.num_nodes() / (num_requests * 0.9 * output_len):.1f} nodes a token")


def memory(rng: random.Random, num_tokens: int) -> str:
    tokens = token_stream(rng, num_tokens)
    tracemalloc.start()
    tree = SuffixTree(24)
    tree.extend(0, tokens)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (f"memory, {num_tokens} tokens in one tree: {held / num_tokens:.0f} bytes a token, "
            f"{held / tree.num_nodes():.0f} a node")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", default="200,2000,8000")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    rng = random.Random(0)
    for prompt_len in map(int, args.prompt_lens.split(",")):
        print(per_request(rng, prompt_len, args.steps))
    print(global_tree(rng, args.requests, 300))
    print(memory(rng, 20000))


if __name__ == "__main__":
    main()
