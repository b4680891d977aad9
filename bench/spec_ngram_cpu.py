"""Speculative decoding with n-gram drafts on the CPU: tokens/s at concurrency 1, greedy, with and without.

An "edit this text" chat prompt (the answer mostly repeats the text, so prompt lookup drafts well) or an open
one (--task open: few drafts hit), the default model, one request at a time. Prints tokens/s of each configuration (best of --repeats, the two interleaved), whether the outputs are
identical, and the acceptance counters. Figures: docs/speculative.md.

    python bench/spec_ngram_cpu.py [--task edit|open] [--max-tokens 160] [--k 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer import LLM, SamplingParams

TEXT = (
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the park, and the childern were playing "
    "on the swings while their parents sat on the benchs and talked about the wether. A man selling ice cream "
    "walked by, and evryone rushed to buy one before they melted in the heat."
)
#: --task: edit (the answer mostly repeats the prompt) or open (open generation: few drafts hit).
TASKS = {
    "edit": f"Fix the spelling mistakes in this text and repeat it in full:\n\n{TEXT}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def measure(llm: LLM, messages: list[dict], params: SamplingParams, repeats: int) -> tuple[float, list[int]]:
    """Best tokens/s over `repeats` runs of the one request (prefill included), and its tokens."""
    best, tokens = 0.0, []
    for _ in range(repeats):
        started = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - started
        best, tokens = max(best, len(out.token_ids) / elapsed), out.token_ids
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="edit")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 on 2 shared cores: OpenMP spins)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    plain = LLM(progress=False, enable_prefix_caching=False)
    spec = LLM(progress=False, enable_prefix_caching=False, speculative_config=spec_config)
    messages = [{"role": "user", "content": TASKS[args.task]}]
    measure(plain, messages, params, 1)  # warm-up
    measure(spec, messages, params, 1)
    warm = spec.engine.spec_decode_stats()  # subtracted below: the measured runs only
    plain_tps = spec_tps = 0.0
    for _ in range(args.repeats):  # interleaved, so a neighbour's load falls on both alike
        tps, plain_tokens = measure(plain, messages, params, 1)
        plain_tps = max(plain_tps, tps)
        tps, spec_tokens = measure(spec, messages, params, 1)
        spec_tps = max(spec_tps, tps)
    stats = spec.engine.spec_decode_stats()
    stats.num_drafts -= warm.num_drafts
    stats.num_draft_tokens -= warm.num_draft_tokens
    stats.num_accepted_tokens -= warm.num_accepted_tokens
    stats.num_accepted_tokens_per_pos = [
        n - (warm.num_accepted_tokens_per_pos[i] if i < len(warm.num_accepted_tokens_per_pos) else 0)
        for i, n in enumerate(stats.num_accepted_tokens_per_pos)]
    print(f"tokens: {len(plain_tokens)} plain, {len(spec_tokens)} speculative; identical: {plain_tokens == spec_tokens}")
    print(f"plain:       {plain_tps:7.1f} tok/s")
    print(f"speculative: {spec_tps:7.1f} tok/s  ({spec_tps / plain_tps:.2f}x)  k={args.k} "
          f"lookup {args.lookup_min}..{args.lookup_max}")
    print(f"acceptance: {stats.acceptance_rate:.2f} of {stats.num_draft_tokens} draft tokens, "
          f"{stats.mean_acceptance_length:.2f} tokens per verify step, per position {stats.num_accepted_tokens_per_pos}"
          f" of {stats.num_drafts} drafts")


if __name__ == "__main__":
    main()
