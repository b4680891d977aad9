"""Speculative decoding on the CPU, n-gram and suffix drafts: tokens/s per user, no speculation vs drafts.

Tasks: "edit" (fix the spelling of a text and repeat it: the answer mostly repeats the prompt, prompt lookup drafts
well), "chat" (a multi-turn chat whose last turn asks to restate an earlier answer with one change), "open" (a
short story: few drafts hit); the same kind of request sent again, as an agent loop does, with a name that changes
each run: "story-again" (the short story, its keeper named; open-ended, the stories part after a few words) and
"code-again" (a Fibonacci function, its name given; the answers share most of their code). The default model;
--concurrency requests at once (copies of the task's chat). Prints tokens/s per user of each mode (best of
--repeats, the mean of them in the -again tasks, whose runs are different requests; the modes interleaved run by
run, so a neighbour's load falls on all alike), whether every run's outputs equal the plain ones (greedy; with
--temperature, seeded sampling, whose outputs follow the target's distribution but not the plain run's draws), and
the acceptance counters (accepted draft tokens per request: the decode steps drafts saved, whatever the load).
Figures:
docs/journal/speculative-2026-12.md (design: docs/speculative.md).

Modes: none; n-gram with a fixed k (an int) or auto; suffix:K or suffix:auto (suffix decoding, vLLM's defaults for
its suffix_decoding_* settings). A suffix mode drafts with a fresh drafter each run (from its request alone, not
from earlier runs, which are this very request again) but in the -again tasks or with --suffix-history.

    PYTHONPATH=shared:. python bench/spec/spec_ngram_cpu.py [--task edit|chat|open|story-again|code-again]
                                   [--modes none,4,auto,suffix:4,suffix:auto] [--concurrency 1] [--max-tokens 160]
                                   [--repeats 3] [--threads 1] [--dtype float32] [--suffix-history]
                                   [--temperature 0.7 --seed 0]
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.drafter import make_drafter
from deepinfer.engine.spec_config import SpeculativeConfig

TEXT = (
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the park, and the childern were playing "
    "on the swings while their parents sat on the benchs and talked about the wether. A man selling ice cream "
    "walked by, and evryone rushed to buy one before they melted in the heat."
)
ANSWER = (
    "Here are three tips for a good night's sleep: 1. Go to bed at the same time every night. 2. Keep your bedroom "
    "dark, quiet and cool. 3. Avoid screens and caffeine in the hour before bed."
)
TASKS = {
    "edit": [{"role": "user", "content": f"Fix the spelling mistakes in this text and repeat it in full:\n\n{TEXT}"}],
    "chat": [{"role": "user", "content": "Give me three tips for a good night's sleep."},
             {"role": "assistant", "content": ANSWER},
             {"role": "user", "content": "Thanks! Repeat the three tips, but make the third about exercise."}],
    "open": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
}
#: The same kind of request sent again (as an agent loop does): run i's request fills in the i-th name (the warm-up
#: is run 0). Only suffix decoding's global tree carries one run's output to the next.
AGAIN = {
    "story-again": ("Write a short story about a lighthouse keeper named {} who finds a message in a bottle.",
                    ["Tom", "Anna", "Elias", "Maria", "John", "Sofia", "Peter", "Lena", "Oscar", "Clara"]),
    "code-again": ("Write a Python function named {} that returns the n-th Fibonacci number, with a docstring.",
                   ["fib", "fibonacci", "nth_fib", "fib_number", "get_fib", "compute_fib", "fibo", "fib_at"]),
}


def conversation(task: str, run: int) -> list[dict]:
    """The task's chat for run `run` (the same every run but for the "-again" tasks)."""
    if task not in AGAIN:
        return TASKS[task]
    template, names = AGAIN[task]
    return [{"role": "user", "content": template.format(names[run % len(names)])}]


def run_once(llm: LLM, conversations: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Tokens/s per user of one batch of conversations (prefill included), and their tokens."""
    started = time.perf_counter()
    outs = [o.outputs[0] for o in llm.chat(conversations, params, use_tqdm=False)]
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outs) / len(outs) / elapsed, [list(o.token_ids) for o in outs]


def spec_config(mode: str, lookup_min: int, lookup_max: int) -> dict | None:
    """None for "none"; suffix decoding for "suffix:K" / "suffix:auto"; else n-gram with k = int(mode) or "auto"."""
    if mode == "none":
        return None
    if mode.startswith("suffix:"):
        k = mode.split(":", 1)[1]
        return {"method": "suffix", "num_speculative_tokens": k if k == "auto" else int(k)}
    return {"method": "ngram", "num_speculative_tokens": mode if mode == "auto" else int(mode),
            "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=[*sorted(TASKS), *AGAIN], default="edit")
    parser.add_argument("--modes", default="none,4,auto",
                        help="comma-separated: none, an int k or auto (n-gram), suffix:K or suffix:auto")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32",
                        help="float32 (the default): in bf16 a verify step's other GEMM shapes part greedy at one-ulp ties")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 on 2 shared cores: OpenMP spins)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (seeded; > 0: the outputs are the target's distribution, not the "
                             "plain run's tokens, so they are not compared)")
    parser.add_argument("--seed", type=int, default=0, help="each request's seed when --temperature > 0")
    parser.add_argument("--suffix-history", action="store_true",
                        help="keep suffix decoding's global tree across runs (always with the -again tasks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampled = args.temperature > 0
    params = SamplingParams(temperature=args.temperature, seed=args.seed if sampled else None,
                            max_tokens=args.max_tokens)
    modes = args.modes.split(",")
    configs = {m: spec_config(m, args.lookup_min, args.lookup_max) for m in modes}
    llms = {m: LLM(progress=False, enable_prefix_caching=False, dtype=args.dtype, speculative_config=configs[m])
            for m in modes}
    fresh = {m for m in modes if m.startswith("suffix:") and args.task not in AGAIN and not args.suffix_history}

    def run(m: str, index: int) -> tuple[float, list[list[int]]]:
        if m in fresh:  # a drafter that has seen no earlier run
            llms[m].engine.install_drafter(make_drafter(SpeculativeConfig.of(configs[m])))
        return run_once(llms[m], [conversation(args.task, index)] * args.concurrency, params)

    tokens = {m: run(m, 0)[1] for m in modes}  # warm-up
    warm = {m: llm.engine.spec_decode_stats() for m, llm in llms.items() if m != "none"}
    # The best run of a task that sends one request; the mean of the runs of an "-again" task, whose runs are
    # different requests (the best would be the easiest one's).
    runs: dict[str, list[float]] = {m: [] for m in modes}
    identical = dict.fromkeys(modes, True)  # to the plain run's tokens, every run
    for index in range(1, args.repeats + 1):  # interleaved run by run
        for m in modes:
            tps, tokens[m] = run(m, index)
            runs[m].append(tps)
        for m in modes:
            identical[m] = identical[m] and tokens[m] == tokens.get("none", tokens[m])
    again = args.task in AGAIN
    figure = {m: sum(r) / len(r) if again else max(r) for m, r in runs.items()}
    base = figure.get("none")
    print(f"task {args.task}, concurrency {args.concurrency}, temperature {args.temperature}, "
          f"{'mean' if again else 'best'} of {args.repeats}, "
          f"{sum(map(len, tokens[modes[0]])) / args.concurrency:.0f} tokens per request (the last run)")
    for m in modes:
        line = f"{m:>11}: {figure[m]:6.1f} tok/s per user"
        if base:
            line += f"  ({figure[m] / base:.2f}x)"
        if "none" in tokens and not sampled:
            line += f"  identical to none: {identical[m]}"
        if m in warm:
            stats, before = llms[m].engine.spec_decode_stats(), warm[m]
            drafted = stats.num_draft_tokens - before.num_draft_tokens
            accepted = stats.num_accepted_tokens - before.num_accepted_tokens
            drafts = stats.num_drafts - before.num_drafts
            line += (f"  acceptance {accepted / drafted if drafted else 0:.2f} of {drafted} draft tokens, "
                     f"{1 + accepted / drafts if drafts else 1:.2f} tokens per verified draft, "
                     f"{accepted / (args.repeats * args.concurrency):.1f} accepted per request")
        print(line)


if __name__ == "__main__":
    main()
