"""The sweep a `bench run` command line asks for: the workload's name, its settings for the JSON, and one plan per
point (deepinfer.bench.load), keyed by the point's value (`{"rate": 4.0}`).

Every point draws its own prompts (the seed and the point's index seed them), so no point is served from the
prefix cache the point before it filled: a concurrency sweep's c=4 does not find c=1's prompts cached. Within a
point, sharing is what the workload makes it: none for the concurrency and rate sweeps, the trace's hash ids for a
replay, the history for conversations. The same flags give the same prompts on every server.
"""

from __future__ import annotations

import argparse

from deepinfer.bench.arrivals import poisson_offsets, trace_offsets
from deepinfer.bench.cost import Weights
from deepinfer.bench.load import ClosedLoop, Conversations, OpenLoop, Plan, completion_body
from deepinfer.bench.prompts import make_prompts, trace_prompt, user_message
from deepinfer.testing.traces import read_trace

#: Requests per point of a concurrency or rate sweep without --num-prompts.
DEFAULT_NUM_PROMPTS = 32


def numbers(text: str, flag: str, positive: bool = True) -> list[float]:
    """A comma-separated list of numbers; ValueError naming the flag otherwise."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if min(values) < 0 or (positive and min(values) == 0):
        raise ValueError(f"{flag} takes {'positive' if positive else 'non-negative'} numbers, got {text!r}")
    return values


def counts(text: str, flag: str) -> list[int]:
    """A comma-separated list of positive integers."""
    values = numbers(text, flag)
    if any(v != int(v) for v in values):
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return [int(v) for v in values]


def check(args: argparse.Namespace) -> None:
    """ValueError for a count that cannot be run."""
    for flag in ("num_prompts", "input_words", "max_tokens", "turns", "processes", "gpus", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} takes a positive integer, got {value}")


def sweep(args: argparse.Namespace, model: str) -> tuple[str, list[tuple[dict, Plan]]]:
    """The workload's name and its points: (the point's key and value, the plan that plays it)."""
    check(args)
    num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS

    def bodies(prompts: list[str], max_tokens: list[int] | None = None) -> tuple[dict, ...]:
        lengths = max_tokens or [args.max_tokens] * len(prompts)
        return tuple(
            completion_body(model, p, n, args.ignore_eos) for p, n in zip(prompts, lengths, strict=True)
        )

    if args.rate is not None:
        return "rate", [
            (
                {"rate": rate},
                OpenLoop(
                    bodies(make_prompts(num_prompts, args.input_words, f"{args.seed}:{index}")),
                    tuple(poisson_offsets(rate, num_prompts, args.seed)),
                ),
            )
            for index, rate in enumerate(numbers(args.rate, "--rate"))
        ]
    if args.trace is not None:
        lines = read_trace(args.trace)[: args.num_prompts]
        if not lines:
            raise ValueError(f"{args.trace} has no trace lines")
        offsets = [line.timestamp for line in lines]
        points = []
        for index, scale in enumerate(numbers(args.time_scale, "--time-scale", positive=False)):
            salt = f"{args.seed}:{index}"
            prompts = [
                trace_prompt(line.hash_ids, line.input_length, args.block_size, n, salt)
                for n, line in enumerate(lines)
            ]
            plan = OpenLoop(
                bodies(prompts, [line.output_length for line in lines]), tuple(trace_offsets(offsets, scale))
            )
            points.append(({"time_scale": scale}, plan))
        return "trace", points
    if args.conversations is not None:
        points = []
        for index, count in enumerate(counts(args.conversations, "--conversations")):
            messages = tuple(
                tuple(user_message(f"{args.seed}:{index}", c, t, args.input_words) for t in range(args.turns))
                for c in range(count)
            )
            points.append(
                ({"conversations": count}, Conversations(model, messages, args.max_tokens, args.ignore_eos))
            )
        return "multiturn", points
    return "concurrency", [
        (
            {"concurrency": c},
            ClosedLoop(bodies(make_prompts(num_prompts, args.input_words, f"{args.seed}:{index}")), c),
        )
        for index, c in enumerate(counts(args.concurrency, "--concurrency"))
    ]


def settings(args: argparse.Namespace, name: str) -> dict:
    """What the workload was made of, and the machine it is priced on (the JSON's `settings`)."""
    machine = {"processes": args.processes, "gpus": args.gpus, "gpu_hour_usd": args.gpu_hour_usd}
    if args.gpu_hour_usd is not None:
        weights = Weights()
        machine["price_weights"] = {"cached_input": weights.cached_input, "output": weights.output}
    common = {"ignore_eos": args.ignore_eos, "seed": args.seed, **machine}
    if name == "trace":
        return {
            "trace": str(args.trace),
            "num_lines": args.num_prompts,
            "block_size": args.block_size,
            **common,
        }
    if name == "multiturn":
        return {"turns": args.turns, "input_words": args.input_words, "max_tokens": args.max_tokens, **common}
    return {
        "num_prompts": args.num_prompts or DEFAULT_NUM_PROMPTS,
        "input_words": args.input_words,
        "max_tokens": args.max_tokens,
        **common,
    }
