"""GPU bench on one device, Llama-3.1-8B shape, random bf16 weights (no download), side by side in one run with
`transformers` (sdpa) and with the ceilings measured in the same run.

    PYTHONPATH=shared:. python bench/gpu/gpu.py [--sections ceilings,prefill,decode,idle,serving,hf] [--layers 32] [--num-requests 1000]
                        [--batch-invariant]   # also: the engine in batch-invariant mode (prefill, decode)
                        [--async-scheduling on|off|both]   # on (default): async, the engine's default on CUDA; off: sync
    PYTHONPATH=shared:. python bench/gpu/gpu.py --model deepseek [--tiny] [--hf-compile]   # DeepSeek-V2-Lite shape: bench/gpu/gpu_deepseek.py

Prints a table and one JSON line; writes the JSON to $OUT/gpu-bench.json when OUT is set (or to --out).
`--baseline EARLIER.json` also prints every figure's change against an earlier run (`deepinfer bench compare`).
Each section appends to the JSON as soon as it ends, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import harness
from bench.gpu.gpu_decode import CONTEXT, busy_fraction, decode_ours, greedy, replay_ms, run_async
from bench.gpu.harness import (
    LLAMA_31_8B,
    PREFILL_LEN,
    PREFILL_SEQS,
    ceilings,
    guarded,
    make_engine,
    prefill_ours,
    release_engines,
    timed,
)


def prefill_attention_s(engine) -> float:
    """Seconds the model's attention op takes over the 4x4096 batch, all layers (the rest is mostly matmuls)."""
    from deepinfer.engine.scheduler import ScheduledRequest

    blocks = PREFILL_LEN // engine.args.block_size
    scheduled = [ScheduledRequest(f"a{i}", [1] * PREFILL_LEN, 0, PREFILL_LEN, list(range(1 + i * blocks,
                 1 + (i + 1) * blocks)), True, True) for i in range(PREFILL_SEQS)]
    cfg, kv = engine.model_config, engine.runner.kv_caches[0]
    with torch.inference_mode():
        inputs = engine.runner.prepare_inputs(scheduled)
        q = torch.randn(PREFILL_SEQS * PREFILL_LEN, cfg.num_attention_heads, cfg.head_dim, device="cuda",
                        dtype=kv.dtype)
        attention = engine.ops.paged_attention
        return timed(lambda: attention(q, kv, inputs.meta, cfg.head_dim**-0.5), reps=5) * cfg.num_hidden_layers


def serving_lengths(num_requests: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Input/output lengths from a fixed-seed lognormal (sigma 1, means 200 / 180 before clipping)."""
    rng = np.random.default_rng(seed)
    draw = lambda mean, size: rng.lognormal(np.log(mean) - 0.5, 1.0, size)  # noqa: E731
    ins = np.clip(np.rint(draw(200, num_requests)), 4, 2048).astype(int).tolist()
    outs = np.clip(np.rint(draw(180, num_requests)), 4, 1024).astype(int).tolist()
    return ins, outs


def serving_ours(engine, num_requests: int) -> dict:
    """Offline throughput through EngineCore: every request queued at once, prompt_token_ids, ignore_eos."""
    ins, outs = serving_lengths(num_requests)
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    graphs, replays0 = engine.runner.graphs, engine.runner.graphs.num_replays
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        engine.add_request(f"s{i}", rng.integers(0, vocab, n_in).tolist(), greedy(n_out))
    num_out, num_steps = 0, 0
    while engine.has_unfinished_requests():
        num_out += sum(len(o.new_token_ids) for o in engine.step())
        num_steps += 1
    elapsed = time.perf_counter() - start
    assert num_out == sum(outs), (num_out, sum(outs))
    return {"num_requests": num_requests, "input_tokens": sum(ins), "output_tokens": num_out,
            "mean_in": round(float(np.mean(ins)), 1), "mean_out": round(float(np.mean(outs)), 1),
            "seconds": round(elapsed, 2), "output_tok_s": round(num_out / elapsed, 1),
            "total_tok_s": round((num_out + sum(ins)) / elapsed, 1), "steps": num_steps,
            "graph_steps": graphs.num_replays - replays0}


def prefill_limit_s(cfg: dict, tflops: float) -> tuple[float, str]:
    """Seconds for 4x4096 cold at the measured matmul rate: linear + causal attention FLOPs."""
    h, i, layers, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    hq, hkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    linear_params = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    tokens, pairs = PREFILL_SEQS * PREFILL_LEN, PREFILL_SEQS * PREFILL_LEN * (PREFILL_LEN + 1) // 2
    flops = 2 * linear_params * tokens + 2 * h * vocab * PREFILL_SEQS + 4 * layers * hq * d * pairs
    formula = ("(2*N_linear*T + 2*H*V*S + 4*L*Hq*D*sum_s S_s(S_s+1)/2) / matmul rate; "
               f"N_linear={linear_params / 1e9:.3f}e9, T={tokens}, {flops / 1e12:.1f} TFLOP")
    return flops / (tflops * 1e12), formula


def decode_roofline(engine, batch: int, context: float, copy_gb_s: float) -> float:
    """tok/s if a step read (every weight but the embedding table + batch*context KV) at the copy bandwidth."""
    weights = sum(p.numel() * p.element_size() for n, p in engine.runner.model.named_parameters()
                  if "embed_tokens" not in n)
    kv = engine.model_config.kv_bytes_per_token(engine.dtype) * batch * context
    return batch / ((weights + kv) / (copy_gb_s * 1e9))


def run_ours(model_dir: Path, cfg: dict, sections: set, res: dict, save, num_requests: int,
             async_scheduling: bool = False) -> None:
    """Every section of our engine, one engine built once (graphs captured once)."""
    engine, build_s = make_engine(model_dir, async_scheduling=async_scheduling)
    res["ours_build_s"] = round(build_s, 1)
    res["capture_sizes"] = engine.runner.graphs.sizes
    res["seq_len_buckets"] = engine.runner.graphs.seq_len_buckets
    rng = np.random.default_rng(0)
    if "prefill" in sections:
        seconds = prefill_ours(engine, rng)
        limit_s, formula = prefill_limit_s(cfg, res["ceilings"]["matmul_tflops"])
        tokens = PREFILL_SEQS * PREFILL_LEN
        res["prefill"] = {"ours_tok_s": round(tokens / seconds, 1), "limit_tok_s": round(tokens / limit_s, 1),
                          "ours_s": round(seconds, 4), "attention_s": round(prefill_attention_s(engine), 4),
                          "limit_formula": formula}
        save()
    if "decode" in sections:
        res["decode"] = {}
        for batch, steps in ((1, 64), (64, 48), (256, 32)):
            graph = decode_ours(engine, rng, batch, steps, eager=False)
            eager = decode_ours(engine, rng, batch, steps, eager=True)
            roof = decode_roofline(engine, batch, CONTEXT + 3 + steps / 2, res["ceilings"]["copy_gb_s"])
            context = CONTEXT + 3 + steps
            res["decode"][str(batch)] = {
                "graphs_tok_s": graph["tok_s"], "graphs_step_ms": graph["step_ms"], "eager_tok_s": eager["tok_s"],
                "eager_step_ms": eager["step_ms"], "graph_replay_ms": round(replay_ms(engine, batch, context), 3),
                "graph_bucket": engine.runner.graphs.bucket(context),
                "graph_replay_ms_max_bucket": round(replay_ms(engine, batch, engine.max_model_len), 3),
                "roofline_tok_s": round(roof, 1), "graphs_of_roofline": round(graph["tok_s"] / roof, 3),
                "graphs_phases_ms": {k: v for k, v in graph.items() if k.endswith("_ms") and k != "step_ms"}}
            save()
    if "idle" in sections:
        res["idle_b64"] = {"graphs": busy_fraction(engine, rng, 64, 20, eager=False),
                           "eager": busy_fraction(engine, rng, 64, 20, eager=True)}
        save()
    if "serving" in sections:
        res["serving"] = serving_ours(engine, num_requests)
        save()
    del engine


def run_invariant(model_dir: Path, res: dict, save) -> None:
    """The engine in batch-invariant mode: prefill 4x4096 and graph decode at B = 1, 64, 256 (its cost)."""
    engine, build_s = make_engine(model_dir, batch_invariant=True)
    rng = np.random.default_rng(2)
    out = res["batch_invariant"] = {"build_s": round(build_s, 1), "decode": {}}
    out["prefill_tok_s"] = round(PREFILL_SEQS * PREFILL_LEN / prefill_ours(engine, rng), 1)
    save()
    for batch, steps in ((1, 32), (64, 24), (256, 16)):
        d = decode_ours(engine, rng, batch, steps, eager=False)
        out["decode"][str(batch)] = {"tok_s": d["tok_s"], "step_ms": d["step_ms"],
                                     "replay_ms": round(replay_ms(engine, batch, CONTEXT + steps), 3)}
        save()
    del engine


def print_table(res: dict) -> None:
    """One line per measured figure."""
    c = res.get("ceilings", {})
    print(f"ceilings: matmul {c.get('matmul_tflops')} TFLOP/s, copy {c.get('copy_gb_s')} GB/s (read+write)")
    p = res.get("prefill", {})
    if p:
        print(f"prefill 4x4096 tok/s: ours {p.get('ours_tok_s')}  transformers {p.get('transformers_tok_s')}  "
              f"limit {p.get('limit_tok_s')}   (ours {p.get('ours_s')} s, attention op {p.get('attention_s')} s)"
              f"   [{p.get('limit_formula')}]")
    print(f"{'decode B':>8} {'graphs':>9} {'eager':>9} {'replay ms':>9} {'step ms':>8} {'roofline':>9} "
          f"{'of roof':>7} {'transformers':>12}")
    for batch, d in res.get("decode", {}).items():
        hf = res.get("transformers_decode", {}).get(batch, {}).get("tok_s", "-")
        print(f"{batch:>8} {d['graphs_tok_s']:>9} {d['eager_tok_s']:>9} {d['graph_replay_ms']:>9} "
              f"{d['graphs_step_ms']:>8} {d['roofline_tok_s']:>9} {d['graphs_of_roofline']:>7} {hf:>12}"
              f"   host ms/step {d.get('graphs_phases_ms')}")
    for mode, v in res.get("idle_b64", {}).items():
        print(f"idle fraction between kernels, decode B=64, {mode}: {v['idle_fraction']} over {v['window_ms']} ms")
    a = res.get("async", {})
    for batch, d in a.get("decode", {}).items():
        sync = res.get("decode", {}).get(batch, {}).get("graphs_tok_s", "-")
        print(f"async scheduling, decode B={batch}: {d['graphs_tok_s']} tok/s (sync {sync}), "
              f"step {d['graphs_step_ms']} ms, host ms/step {d['graphs_phases_ms']}")
    for mode, v in a.get("idle_b64", {}).items():
        print(f"async scheduling, idle fraction B=64, {mode}: {v.get('idle_fraction')} "
              f"(GPU busy {v.get('gpu_busy_fraction')}) over {v.get('window_ms')} ms")
    if a.get("serving"):
        print(f"async scheduling, serving: {a['serving']['output_tok_s']} output tok/s, {a['serving']['steps']} steps")
    bi = res.get("batch_invariant")
    if bi:
        print(f"batch-invariant: prefill 4x4096 {bi.get('prefill_tok_s')} tok/s; decode tok/s (graphs) "
              + ", ".join(f"B={b}: {d['tok_s']}" for b, d in bi.get("decode", {}).items()))
    s = res.get("serving")
    if s:
        print(f"serving {s['num_requests']} req (mean {s['mean_in']} in / {s['mean_out']} out): "
              f"{s['output_tok_s']} output tok/s, {s['total_tok_s']} total tok/s, {s['seconds']} s, "
              f"{s['steps']} steps ({s['graph_steps']} graph replays)")


def main() -> None:
    """Run the chosen sections; table, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="ceilings,prefill,decode,idle,serving,hf")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="an earlier run's JSON: print every figure's change against it (deepinfer bench compare)")
    parser.add_argument("--batch-invariant", action="store_true", help="also measure batch-invariant mode")
    parser.add_argument("--async-scheduling", choices=("off", "on", "both"), default="on",
                        help="on (default, the engine's own default on one CUDA device): async; off: synchronous; "
                             "both: sync, then decode/idle/serving again async")
    parser.add_argument("--model", choices=("llama", "deepseek"), default="llama",
                        help="deepseek: DeepSeek-V2-Lite shape, MLA + MoE (bench/gpu/gpu_deepseek.py)")
    parser.add_argument("--tiny", action="store_true", help="deepseek: a toy config on the CPU (code paths only)")
    parser.add_argument("--hf-compile", action="store_true", help="deepseek: let transformers compile its decode")
    parser.add_argument("--execution-mode", choices=("eager", "decode", "piecewise", "full"), default="full",
                        help="which steps replay CUDA graphs (decode: prompt and mixed steps eager)")
    args = parser.parse_args()
    harness.EXECUTION_MODE = args.execution_mode
    if args.model == "deepseek":
        from bench.gpu.gpu_deepseek import main_deepseek

        main_deepseek(args)
        return
    args.layers = args.layers or LLAMA_31_8B["num_hidden_layers"]
    sections = set(args.sections.split(","))
    out = args.out or (Path(os.environ["OUT"]) / "gpu-bench.json" if os.environ.get("OUT") else None)
    cfg = {**LLAMA_31_8B, "num_hidden_layers": args.layers}
    res: dict = {"bench": "gpu", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "layers": args.layers, "sections": sorted(sections), "date": time.strftime("%Y-%m-%d"),
                 "async_scheduling": args.async_scheduling, "execution_mode": harness.EXECUTION_MODE}

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(res, indent=1))

    # Without the ceilings section, the limits use ANCHORS.md's figures for an H200.
    res["ceilings"] = ceilings() if "ceilings" in sections else {"matmul_tflops": 741.0, "copy_gb_s": 3979.0}
    torch.cuda.empty_cache()  # the engine plans its KV cache from the free memory
    save()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(cfg))
        if sections & {"prefill", "decode", "idle", "serving"}:
            on = args.async_scheduling == "on"
            guarded(res, "ours_error", lambda: run_ours(model_dir, cfg, sections, res, save, args.num_requests, on))
            release_engines()
        if args.async_scheduling == "both" and sections & {"decode", "idle", "serving"}:
            serving = lambda engine: serving_ours(engine, args.num_requests)  # noqa: E731
            guarded(res, "async_error", lambda: run_async(make_engine, model_dir, sections, res, save, serving))
            release_engines()
        if args.batch_invariant:
            guarded(res, "batch_invariant_error", lambda: run_invariant(model_dir, res, save))
            release_engines()
        if "hf" in sections:
            from bench.gpu.gpu_hf import run_hf

            guarded(res, "transformers_error", lambda: run_hf(model_dir, cfg, res, save))
        save()
    print_table(res)
    if args.baseline is not None:  # the regression guard: a slower step is seen the day it lands
        from deepinfer.bench.compare import compare, table

        print(f"\nagainst {args.baseline}:\n{table(compare(json.loads(args.baseline.read_text()), res))}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
