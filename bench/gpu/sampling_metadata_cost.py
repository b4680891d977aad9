"""Host time of one step's sampling metadata and sampled-token index copies, before and after
`SamplingMetadataBuilder` / `HostStaging`, in one run.

    PYTHONPATH=shared:. python bench/gpu/sampling_metadata_cost.py [--device cpu|cuda] [--rounds 7]

before: the per-step rebuild from every row's params (`deepinfer.testing.sampling_reference.reference_build`,
the code the builder replaced) and `SampledTokenBuffer`'s old index copy (`torch.tensor(lists, pin_memory=...)`).
after: one builder kept across steps (as `ModelRunner` keeps it): `steady` keeps the batch, `churn` replaces one
request every step (a SamplingParams object it has not seen: its RowConstants and the batch's packed constants
are rebuilt; at c=64 with 256-token answers a decode batch changes about every 4th step).
Batches: greedy (every row temperature 0) and mixed (greedy, temperature, top-k, top-p, min-p, logprobs); the
penalty / logit_bias / min_tokens paths build the same dense [B, V] tensors on both sides (tests compare them).
µs per call over `--rounds` interleaved rounds: the table shows the fastest round (the least disturbed by other
processes on a shared host), the JSON line the fastest and the median. On cuda the copies are pinned and
non_blocking (host time only, synced per round). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from deepinfer.engine.async_step import SampledTokenBuffer
from deepinfer.sampling.metadata import _MAX_CACHED_ROWS, SamplingMetadataBuilder
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.sampling_reference import Step, random_step, reference_build

VOCAB = 128_256
SIZES = (1, 64, 256)
_TARGET_ROUND_S = 0.15
_NUM_ARRIVALS = 3 * _MAX_CACHED_ROWS


def mixed_params(rng: random.Random, kind: str) -> SamplingParams:
    seed = rng.randrange(2**63)
    if kind == "greedy" or rng.random() < 0.4:
        return SamplingParams(temperature=0.0, seed=seed)
    return SamplingParams(temperature=rng.choice([0.6, 1.0]), top_k=rng.choice([0, 50]), top_p=rng.choice([1.0, 0.9]),
                          min_p=rng.choice([0.0, 0.05]), logprobs=rng.choice([None, 0, 5]), seed=seed)


def make_step(rng: random.Random, kind: str, size: int) -> Step:
    step = random_step(rng, [mixed_params(rng, kind) for _ in range(size)], VOCAB, [128001, 128009])
    step.output_token_ids = [list(range(rng.randrange(0, 8))) for _ in range(size)]
    return step


def per_call_us(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """A round: calls `fn` for about _TARGET_ROUND_S (count fixed by a first calibration), µs per call."""
    started = time.perf_counter()
    fn()
    calls = max(5, int(_TARGET_ROUND_S / max(time.perf_counter() - started, 1e-6)))

    def one_round() -> float:
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) / calls * 1e6

    return one_round


def metadata_cases(kind: str, size: int, device: torch.device) -> dict[str, Callable[[], object]]:
    rng = random.Random(size)
    step = make_step(rng, kind, size)
    steady, churning = SamplingMetadataBuilder(device), SamplingMetadataBuilder(device)
    # Arrivals: new params objects, made before the clock runs (more than the builder keeps, so never cached).
    arrivals = itertools.cycle([copy.copy(mixed_params(rng, kind)) for _ in range(_NUM_ARRIVALS)])
    churn = {"i": 0}

    def churn_build() -> object:
        churn["i"] += 1
        step.params_list[churn["i"] % size] = next(arrivals)
        return churning.build(*step.args(), **step.kwargs())

    return {
        "before": lambda: reference_build(*step.args(), device, **step.kwargs()),
        "after_steady": lambda: steady.build(*step.args(), **step.kwargs()),
        "after_churn": churn_build,
    }


def old_indices(lists: tuple[list[int], ...], device: torch.device) -> torch.Tensor:
    """SampledTokenBuffer._indices before HostStaging."""
    pinned = device.type == "cuda"
    host = torch.tensor(lists, dtype=torch.int64, pin_memory=pinned)
    return host.to(device, non_blocking=True) if pinned else host


def token_buffer_cases(size: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """One step's record(rows) + fill(placeholders, rows) index copies (the device index ops are the same)."""
    buffer = SampledTokenBuffer(size + 1, device)
    rows, placeholders = list(range(1, size + 1)), list(range(size))
    input_ids = torch.zeros(size, dtype=torch.int64, device=device)
    sampled = torch.zeros(size, dtype=torch.int64, device=device)

    def before() -> None:
        buffer.token_ids.index_copy_(0, old_indices((rows,), device)[0], sampled)
        index = old_indices((placeholders, rows), device)
        input_ids.index_copy_(0, index[0], buffer.token_ids.index_select(0, index[1]))

    def after() -> None:
        buffer.record(rows, sampled, size + 1)
        buffer.fill(input_ids, placeholders, rows)

    return {"before": before, "after_steady": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    benches: dict[str, dict[str, Callable[[], object]]] = {}
    for size in SIZES:
        for kind in ("greedy", "mixed"):
            benches[f"metadata/{kind}/B={size}"] = metadata_cases(kind, size, device)
        benches[f"token_buffer/B={size}"] = token_buffer_cases(size, device)
    rounds = {name: {case: per_call_us(fn, device) for case, fn in cases.items()} for name, cases in benches.items()}
    samples: dict[str, dict[str, list[float]]] = {name: {case: [] for case in cases} for name, cases in rounds.items()}
    for _ in range(args.rounds):  # interleaved, so a noisy neighbour hits before and after alike
        for name, cases in rounds.items():
            for case, one_round in cases.items():
                samples[name][case].append(one_round())
    results = {name: {case: round(min(v), 2) for case, v in cases.items()} for name, cases in samples.items()}
    medians = {name: {case: round(statistics.median(v), 2) for case, v in cases.items()}
               for name, cases in samples.items()}
    print(f"{'bench':<28}{'before µs':>12}{'after µs':>12}{'churn µs':>12}{'before/after':>14}")
    for name, r in results.items():
        churn = f"{r['after_churn']:>12.1f}" if "after_churn" in r else f"{'':>12}"
        print(f"{name:<28}{r['before']:>12.1f}{r['after_steady']:>12.1f}{churn}{r['before'] / r['after_steady']:>14.1f}")
    print(json.dumps({"bench": "sampling_metadata_cost", "device": str(device), "vocab_size": VOCAB,
                      "rounds": args.rounds, "torch": torch.__version__, "us_per_call_min": results,
                      "us_per_call_median": medians}))


if __name__ == "__main__":
    main()
