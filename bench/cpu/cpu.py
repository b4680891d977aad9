"""CPU bench: prefill and decode of our offline engine against `transformers` (sdpa), same weights, same process.

    PYTHONPATH=shared:. python bench/cpu/cpu.py [--prefill 512,2048,6000,8000] [--decode 1,8] [--repeats 3] [--threads 2] [--dtype float32]
                        [--hf-dtype float32] [--decode-context 512] [--decode-steps 64] [--model NAME_OR_PATH]

Prefill: one prompt of fresh random token ids (never a prefix hit), max_tokens=1 on both sides (`LLM.generate`
against `generate(max_new_tokens=1)`). Decode at batch B over a --decode-context-token prompt each, both sides as
time(1 + N tokens) - time(1 token), N = --decode-steps: ours with the prompts already cached (the prefill step of the
difference is then one row per sequence), transformers re-running its prefill in both terms. The sides alternate
which goes first, repeat by repeat, so the load of a shared machine falls on both alike; every repeat is printed,
the table holds medians and the ratio ours/transformers (> 1 = ours faster), by wall time and by this process's CPU
time (user + system: with --threads 1 the work done, whatever the machine's load; with more threads it counts
OpenMP's spin-waits too). Ends with one JSON line (--out: also to a file). --hf-dtype differs from --dtype for the
`auto` comparison (ours bf16 against transformers float32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bench.results_io import emit_json_line


class Timing(NamedTuple):
    """Seconds of one measured call: wall clock, and this process's CPU time (user + system, all threads)."""

    wall_s: float
    cpu_s: float


def _timed(fn) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def _ours(llm, prompts: list[list[int]], max_tokens: int) -> Timing:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    timing = _timed(lambda: outs.extend(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                     use_tqdm=False)))
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return timing


def _hf(model, prompts: list[list[int]], max_tokens: int) -> Timing:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    outs = []

    def generate():
        with torch.inference_mode():
            outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0))

    timing = _timed(generate)
    assert outs[0].shape[1] == ids.shape[1] + max_tokens
    return timing


def _both(ours, hf, ours_first: bool) -> tuple[Timing, Timing]:
    if ours_first:
        o = ours()
        return o, hf()
    h = hf()
    return ours(), h


def _rate(num_tokens: int, long: Timing, short: Timing) -> Timing:
    """Tokens per second of the difference of two calls (wall and CPU)."""
    return Timing(num_tokens / (long.wall_s - short.wall_s), num_tokens / (long.cpu_s - short.cpu_s))


def prefill_row(llm, hf, rng, vocab: int, length: int, repeats: int) -> dict:
    """Seconds of a cold prefill of `length` tokens, each repeat on a fresh random prompt."""
    ours_runs, hf_runs = [], []
    for r in range(repeats):
        prompt = rng.integers(0, vocab, length).tolist()
        o, h = _both(lambda p=prompt: _ours(llm, [p], 1), lambda p=prompt: _hf(hf, [p], 1), r % 2 == 0)
        ours_runs.append(o)
        hf_runs.append(h)
        print(f"  prefill {length:>6} repeat {r}: ours {o.wall_s:7.2f} s ({o.cpu_s:.2f} cpu)  transformers "
              f"{h.wall_s:7.2f} s ({h.cpu_s:.2f} cpu)  {_load()}", flush=True)
    return _summary(f"prefill {length}", "s", ours_runs, hf_runs, lower_is_better=True)


def decode_row(llm, hf, rng, vocab: int, batch: int, context: int, steps: int, repeats: int) -> dict:
    """Decode tok/s of `steps` tokens for `batch` sequences after a `context`-token prompt each."""
    ours_runs, hf_runs = [], []
    for r in range(repeats):
        prompts = [rng.integers(0, vocab, context).tolist() for _ in range(batch)]
        _ours(llm, prompts, 1)  # cache the prompts

        def ours(p=prompts):
            return _rate(batch * steps, _ours(llm, p, 1 + steps), _ours(llm, p, 1))

        def theirs(p=prompts):
            return _rate(batch * steps, _hf(hf, p, 1 + steps), _hf(hf, p, 1))

        o, h = _both(ours, theirs, r % 2 == 0)
        ours_runs.append(o)
        hf_runs.append(h)
        print(f"  decode B={batch:<3} repeat {r}: ours {o.wall_s:7.1f} tok/s ({o.cpu_s:.1f} per cpu s)  transformers "
              f"{h.wall_s:7.1f} tok/s ({h.cpu_s:.1f} per cpu s)  {_load()}", flush=True)
    return _summary(f"decode B={batch}", "tok/s", ours_runs, hf_runs, lower_is_better=False)


def _summary(name: str, unit: str, ours_runs: list[Timing], hf_runs: list[Timing], lower_is_better: bool) -> dict:
    """Medians and ratios (> 1 = ours faster) by wall and by CPU time, and every run."""
    row = {"name": name, "unit": unit}
    for field, suffix in (("wall_s", ""), ("cpu_s", "_cpu")):
        ours = statistics.median(getattr(t, field) for t in ours_runs)
        hf = statistics.median(getattr(t, field) for t in hf_runs)
        row |= {f"ours{suffix}": round(ours, 3), f"transformers{suffix}": round(hf, 3),
                f"ratio{suffix}": round(hf / ours if lower_is_better else ours / hf, 2),
                f"ours{suffix}_runs": [round(getattr(t, field), 3) for t in ours_runs],
                f"transformers{suffix}_runs": [round(getattr(t, field), 3) for t in hf_runs]}
    return row


def _load() -> str:
    return "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def main() -> None:
    """Build both sides, run the rows, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefill", default="512,2048,6000,8000", help="prompt lengths ('' = none)")
    parser.add_argument("--decode", default="1,8", help="decode batch sizes ('' = none)")
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="ours: float32 | bfloat16 | auto")
    parser.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: the one ours resolved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from deepinfer import LLM

    lengths = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode.split(",") if x]
    max_len = max([*lengths, args.decode_context]) + args.decode_steps + 2
    llm = LLM(args.model, device="cpu", dtype=args.dtype, progress=False, max_model_len=max(max_len, 8192),
              max_num_seqs=max([*batches, 8]))
    ours_dtype = llm.engine.core.dtype
    hf_dtype = getattr(torch, args.hf_dtype) if args.hf_dtype else ours_dtype
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=hf_dtype, attn_implementation="sdpa")
    hf.eval()
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(args.seed)
    warm = rng.integers(0, vocab, 64).tolist()
    _ours(llm, [warm], 4)
    _hf(hf, [warm], 4)
    print(f"model={llm.engine.model_dir.name} ours dtype={ours_dtype} transformers dtype={hf_dtype} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} {_load()}", flush=True)
    rows = [prefill_row(llm, hf, rng, vocab, n, args.repeats) for n in lengths]
    rows += [decode_row(llm, hf, rng, vocab, b, args.decode_context, args.decode_steps, args.repeats)
             for b in batches]
    print(f"{'row':<16}{'unit':>7}{'transformers':>14}{'deepinfer':>12}{'ratio':>8}{'cpu ratio':>11}")
    for row in rows:
        print(f"{row['name']:<16}{row['unit']:>7}{row['transformers']:>14.2f}{row['ours']:>12.2f}{row['ratio']:>8.2f}"
              f"{row['ratio_cpu']:>11.2f}")
    emit_json_line({
        "bench": "cpu", "model": llm.engine.model_dir.name, "dtype": str(ours_dtype), "hf_dtype": str(hf_dtype),
        "threads": torch.get_num_threads(), "repeats": args.repeats, "decode_context": args.decode_context,
        "decode_steps": args.decode_steps, "load_end": [round(x, 1) for x in os.getloadavg()], "rows": rows,
        "host": platform.node(), "cpu_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(),
    }, args.out)


if __name__ == "__main__":
    main()
