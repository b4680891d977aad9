"""Does the garbage collector move the offline engine's figure? The offline point of bench/serve/serve.py, repeated,
alternating without and with `gc.freeze()` of the loaded engine (the workers freeze theirs), in one process.

    PYTHONPATH=shared:. python bench/serve/offline_gc.py --random-model llama-1b --device cuda --concurrency 64 --repeats 3 --max-tokens 256
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

from bench.results_io import emit_json_line
from bench.serve.serve import add_model_arguments, offline_point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of (no freeze, freeze)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--offline-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model
    if args.random_model:
        from deepinfer.testing.random_model import write_random_model

        model = str(write_random_model(args.random_model, args.cache_dir))
    options = {"load_format": "dummy"} if args.random_model else {}
    if args.device != "auto":
        options["device"] = args.device
    runs = {False: [], True: []}
    collections = {False: [], True: []}
    for repeat in range(args.repeats):
        for freeze in (False, True):
            before = sum(s["collections"] for s in gc.get_stats())
            point = offline_point(args, model, args.concurrency, options, gc_freeze=freeze)
            collections[freeze].append(sum(s["collections"] for s in gc.get_stats()) - before)
            runs[freeze].append(point["offline_output_tok_s"])
            print(f"repeat {repeat} freeze={freeze}: {point['offline_output_tok_s']} tok/s, "
                  f"{point['offline_mean_step_ms']} ms a step, TTFT p50 {point['offline_ttft_ms_p50']} ms, "
                  f"{collections[freeze][-1]} collections", flush=True)
    summary = {"bench": "offline_gc", "model": args.random_model or model, "concurrency": args.concurrency,
               "max_tokens": args.max_tokens, "tok_s": {"no_freeze": runs[False], "freeze": runs[True]},
               "collections": {"no_freeze": collections[False], "freeze": collections[True]},
               "median_no_freeze": statistics.median(runs[False]), "median_freeze": statistics.median(runs[True])}
    print(f"\nmedian tok/s: no freeze {summary['median_no_freeze']}, freeze {summary['median_freeze']}")
    emit_json_line(summary, args.out)


if __name__ == "__main__":
    main()
