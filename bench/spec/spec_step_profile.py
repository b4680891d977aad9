"""Where a verify step's time goes: one GPU, 8B shape, random bf16 weights, the oracle drafter of spec_oracle_gpu.

The oracle bench (spec_oracle_gpu.py) found verify steps far slower than plain ones on an H200 (k=3 at alpha=0.9,
c=1: ~3.4 tokens a step but 94 tok/s per user against 211 without speculation). This bench times the engine's
steps per execution mode, with and without drafts, and profiles one batch of each:

  mode     the engine's execution_mode: full (the default: decode graphs + full prompt graphs, which verify steps
           run since they fit a bucket's slots), decode (decode graphs only: verify steps eager), eager
  drafts   none (the speculating engine, no drafter installed: plain steps) or kK (the oracle at --alpha, K = --k)

For every (mode, drafts, concurrency): decode steps' wall time (median, p90), tokens a step, the share of the step in
`execute` / `execute_verify` (the runner) and in the drafter's propose, and tok/s per user; for c=1 (and the largest
c) torch.profiler's top operators by host time and by device time, one text file each under --out-dir.

    PYTHONPATH=shared:. python -m bench.spec.spec_step_profile [--modes full,decode,eager] [--concurrency 1,64]
                                                               [--k 3] [--alpha 0.9] [--out-dir $OUT/spec-profile]
    PYTHONPATH=shared:. python -m bench.spec.spec_step_profile --quick   # a two-layer toy on the CPU (eager only)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.spec.spec_oracle_gpu import (
    VOCAB_SIZE,
    SuccessorDrafter,
    greedy,
    make_engine,
    model_config_dir,
    successor_permutation,
)
from deepinfer.engine.core import EngineCore


class StepClock:
    """Wall time of each engine step and of the runner's and drafter's parts, through their public methods."""

    def __init__(self, engine: EngineCore) -> None:
        self.parts: dict[str, float] = {"execute": 0.0, "execute_verify": 0.0, "propose": 0.0}
        runner = engine.runner
        for name in ("execute", "execute_verify"):
            setattr(runner, name, self._timed(name, getattr(runner, name)))
        self._engine = engine

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.parts[name] += time.perf_counter() - t0

        return timed

    def watch_drafter(self) -> None:
        """Time the drafter installed now (install_drafter replaces it)."""
        drafter = self._engine.drafter
        if drafter is not None:
            drafter.propose = self._timed("propose", drafter.propose)

    def reset(self) -> None:
        self.parts = dict.fromkeys(self.parts, 0.0)


def run_batch(engine: EngineCore, clock: StepClock, prompts: list[list[int]], tag: str, max_tokens: int) -> dict:
    """Every prompt at once, stepped to the end: decode steps' wall times, tokens a step, the parts' shares."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, greedy(max_tokens))
    step_s, step_tokens, first, last, counts = [], [], {}, {}, dict.fromkeys(ids, 0)
    prefill_done = False
    clock.reset()
    total_t0 = time.perf_counter()
    decode_t0 = None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        emitted = sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            if o.new_token_ids:
                counts[o.request_id] += len(o.new_token_ids)
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
        if prefill_done:
            step_s.append(now - t0)
            step_tokens.append(emitted)
        elif len(first) == len(ids):
            prefill_done, decode_t0 = True, now
            clock.reset()
    decode_s = time.perf_counter() - (decode_t0 or total_t0)
    per_user = [(counts[r] - 1) / (last[r] - first[r]) for r in ids if last[r] > first[r]]
    step_s.sort()
    return {
        "steps": len(step_s),
        "step_ms_median": round(1e3 * statistics.median(step_s), 3) if step_s else None,
        "step_ms_p90": round(1e3 * step_s[int(0.9 * (len(step_s) - 1))], 3) if step_s else None,
        "tokens_per_step": round(sum(step_tokens) / max(1, len(step_tokens)) / len(ids), 2),
        "per_user_tok_s": round(statistics.mean(per_user), 1) if per_user else 0.0,
        "share": {k: round(v / decode_s, 3) for k, v in clock.parts.items()},
    }


def profile_batch(engine: EngineCore, clock: StepClock, prompts, tag: str, max_tokens: int, path: Path) -> None:
    """torch.profiler over one batch: the top operators by host and by device time, into `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run_batch(engine, clock, prompts, tag, max_tokens)
    table = prof.key_averages()
    text = [f"# {tag}: top operators by self host time", table.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        text += [f"# {tag}: top operators by device time", table.table(sort_by="self_cuda_time_total", row_limit=25)]
    path.write_text("\n\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(".bench-models/llama-8b"))
    parser.add_argument("--modes", default=None, help="execution modes (default full,decode,eager; --quick: eager)")
    parser.add_argument("--concurrency", default=None, help="default 1,64 (--quick: 1,4)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a tiny random model on the CPU, float32")
    parser.add_argument("--out-dir", type=Path, default=None, help="default $OUT/spec-profile")
    args = parser.parse_args()
    device, dtype = ("cpu", "float32") if args.quick else ("cuda", "bfloat16")
    modes = (args.modes or ("eager" if args.quick else "full,decode,eager")).split(",")
    concurrencies = [int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,64")).split(",")]
    out_dir = args.out_dir or Path(os.environ.get("OUT", "bench/results")) / "spec-profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    permutation = successor_permutation(VOCAB_SIZE)
    prompts = {c: np.random.default_rng(c).integers(0, VOCAB_SIZE, (c, args.prompt_len)).tolist()
               for c in concurrencies}
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = model_config_dir(args, Path(tmp))
        for mode in modes:
            engine = make_engine(args.model_dir, device, dtype, True, args.prompt_len + args.max_tokens + 64,
                                 permutation, 1e-4, execution_mode=mode)
            clock = StepClock(engine)
            for drafts in ("none", f"k{args.k}"):
                if drafts == "none":
                    engine.install_drafter(None)
                else:
                    engine.install_drafter(SuccessorDrafter(permutation, args.alpha), args.k)
                    clock.watch_drafter()
                for c in concurrencies:
                    tag = f"{mode}-{drafts}-c{c}"
                    run_batch(engine, clock, prompts[c], f"{tag}-warm", 16)
                    row = {"mode": mode, "drafts": drafts, "concurrency": c,
                           **run_batch(engine, clock, prompts[c], tag, args.max_tokens)}
                    rows.append(row)
                    print(f"[{time.perf_counter() - started:6.1f} s] {json.dumps(row)}", flush=True)
                    if c in (concurrencies[0], concurrencies[-1]):
                        profile_batch(engine, clock, prompts[c], f"{tag}-prof", args.max_tokens,
                                      out_dir / f"{tag}.txt")
            gc.unfreeze()  # make_engine froze it: its cycles must be collectable for its memory to go back
            del engine, clock
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    (out_dir / "steps.json").write_text(json.dumps({"config": vars(args) | {"model_dir": str(args.model_dir),
                                                                          "out_dir": str(out_dir)},
                                                    "rows": rows}, indent=1))
    print(f"{'mode':>7} {'drafts':>6} {'c':>4} | {'ms/step':>8} {'p90':>7} | {'tok/step':>8} | {'tok/s/user':>10} | "
          "execute execute_verify propose")
    for r in rows:
        s = r["share"]
        print(f"{r['mode']:>7} {r['drafts']:>6} {r['concurrency']:>4} | {r['step_ms_median']:>8} {r['step_ms_p90']:>7} | "
              f"{r['tokens_per_step']:>8} | {r['per_user_tok_s']:>10} | {s['execute']:.2f} {s['execute_verify']:.2f} "
              f"{s['propose']:.2f}")


if __name__ == "__main__":
    main()
