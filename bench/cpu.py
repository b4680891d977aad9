"""CPU bench: prefill and decode of our offline engine against `transformers` (sdpa), same weights, same process.

    python bench/cpu.py [--prefill 512,2048,6000] [--decode 1,8] [--repeats 3] [--threads 2] [--dtype float32]
                        [--hf-dtype float32] [--decode-context 512] [--decode-steps 64] [--model NAME_OR_PATH]

Prefill: one prompt of fresh random token ids (never a prefix hit), max_tokens=1 on both sides (`LLM.generate`
against `generate(max_new_tokens=1)`). Decode at batch B over a --decode-context-token prompt each, both sides as
time(1 + N tokens) - time(1 token), N = --decode-steps: ours with the prompts already cached (the prefill step of the
difference is then one row per sequence), transformers re-running its prefill in both terms. The sides alternate
which goes first, repeat by repeat, so the load of a shared machine falls on both alike; every repeat is printed,
the table holds medians and the ratio ours/transformers (> 1 = ours faster). Ends with one JSON line (--out: also
to a file). --hf-dtype differs from --dtype for the `auto` comparison (ours bf16 against transformers float32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from results_io import emit_json_line


def _ours_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def _hf_s(model, prompts: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + max_tokens
    return elapsed


def _both(ours, hf, ours_first: bool) -> tuple[float, float]:
    if ours_first:
        o = ours()
        return o, hf()
    h = hf()
    return ours(), h


def prefill_row(llm, hf, rng, vocab: int, length: int, repeats: int) -> dict:
    """Seconds of a cold prefill of `length` tokens, each repeat on a fresh random prompt."""
    ours_runs, hf_runs = [], []
    for r in range(repeats):
        prompt = rng.integers(0, vocab, length).tolist()
        o, h = _both(lambda p=prompt: _ours_s(llm, [p], 1), lambda p=prompt: _hf_s(hf, [p], 1), r % 2 == 0)
        ours_runs.append(o)
        hf_runs.append(h)
        print(f"  prefill {length:>6} repeat {r}: ours {o:7.2f} s  transformers {h:7.2f} s  {_load()}", flush=True)
    return _summary(f"prefill {length}", "s", ours_runs, hf_runs, lower_is_better=True)


def decode_row(llm, hf, rng, vocab: int, batch: int, context: int, steps: int, repeats: int) -> dict:
    """Decode tok/s of `steps` tokens for `batch` sequences after a `context`-token prompt each."""
    ours_runs, hf_runs = [], []
    for r in range(repeats):
        prompts = [rng.integers(0, vocab, context).tolist() for _ in range(batch)]
        _ours_s(llm, prompts, 1)  # cache the prompts

        def ours(p=prompts):
            return batch * steps / (_ours_s(llm, p, 1 + steps) - _ours_s(llm, p, 1))

        def theirs(p=prompts):
            return batch * steps / (_hf_s(hf, p, 1 + steps) - _hf_s(hf, p, 1))

        o, h = _both(ours, theirs, r % 2 == 0)
        ours_runs.append(o)
        hf_runs.append(h)
        print(f"  decode B={batch:<3} repeat {r}: ours {o:7.1f} tok/s  transformers {h:7.1f} tok/s  {_load()}",
              flush=True)
    return _summary(f"decode B={batch}", "tok/s", ours_runs, hf_runs, lower_is_better=False)


def _summary(name: str, unit: str, ours_runs: list[float], hf_runs: list[float], lower_is_better: bool) -> dict:
    ours, hf = statistics.median(ours_runs), statistics.median(hf_runs)
    return {"name": name, "unit": unit, "ours": round(ours, 3), "transformers": round(hf, 3),
            "ratio": round(hf / ours if lower_is_better else ours / hf, 2),
            "ours_runs": [round(x, 3) for x in ours_runs], "transformers_runs": [round(x, 3) for x in hf_runs]}


def _load() -> str:
    return "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def main() -> None:
    """Build both sides, run the rows, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefill", default="512,2048,6000", help="prompt lengths ('' = none)")
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
    _ours_s(llm, [warm], 4)
    _hf_s(hf, [warm], 4)
    print(f"model={llm.engine.model_dir.name} ours dtype={ours_dtype} transformers dtype={hf_dtype} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} {_load()}", flush=True)
    rows = [prefill_row(llm, hf, rng, vocab, n, args.repeats) for n in lengths]
    rows += [decode_row(llm, hf, rng, vocab, b, args.decode_context, args.decode_steps, args.repeats)
             for b in batches]
    print(f"{'row':<16}{'unit':>7}{'transformers':>14}{'deepinfer':>12}{'ratio':>8}")
    for row in rows:
        print(f"{row['name']:<16}{row['unit']:>7}{row['transformers']:>14.2f}{row['ours']:>12.2f}{row['ratio']:>8.2f}")
    emit_json_line({
        "bench": "cpu", "model": llm.engine.model_dir.name, "dtype": str(ours_dtype), "hf_dtype": str(hf_dtype),
        "threads": torch.get_num_threads(), "repeats": args.repeats, "decode_context": args.decode_context,
        "decode_steps": args.decode_steps, "load_end": [round(x, 1) for x in os.getloadavg()], "rows": rows,
        "host": platform.node(), "cpu_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(),
    }, args.out)


if __name__ == "__main__":
    main()
