"""Speculative decoding's machinery at a known acceptance: one GPU, 8B shape, random bf16 weights, an oracle drafter.

Random weights give drafts nothing to hit, so this bench drafts with an oracle (issue #32) over a *successor model*:
the random model's weights made so that its greedy next token is a fixed permutation pi of the current token by a
wide margin (the lm_head's row pi(t) is token t's embedding; the layers' output projections, o_proj and down_proj,
scaled by --residual-scale, so the residual stream stays the current token's embedding). Every GEMM, attention read
and kernel is the one the plain model runs, only the answer is known: the continuation of a prompt is the pi-walk
from its last token, and a bf16 near-tie cannot decide it otherwise (the first run of this bench, with a
continuation precomputed by a plain run, parted from it within a few tokens: random weights make near-ties the
rule). The oracle follows each request's own last token: its draft is the next pi-steps, each token kept with
probability alpha and otherwise replaced by a wrong one, so the target accepts position i with probability
alpha^(i+1). Every run's tokens are checked against the pi-walk (`diverged`, 0 when the machinery is exact). The
oracle is no `speculative_config.method`: it lives in this file only and is installed through the engine's public
hook (`EngineCore.install_drafter`) on an engine built with n-gram drafting.

In one run, greedy, every request a ~128-token random prompt and exactly --max-tokens output tokens:
  none        a plain engine (async scheduling on, as users get it on CUDA): the reference tokens, per concurrency
  none-sync   the speculating engine with no drafter installed (its plain steps: synchronous before its async
              scheduling with drafts, docs/speculative.md "Async scheduling"; the name kept for comparisons)
  k=K         the oracle's drafts, K tokens verified every step, at each alpha
  auto        the oracle's drafts of up to 8 tokens, the draft controller choosing how many (engine/draft_controller.py)
at concurrency c in --concurrency (all c requests added at once). Per user: the mean over requests of
(output tokens - 1) / (last token time - first token time), the decode rate a client sees after its first token;
total: all output tokens / the batch's wall time (prefill included).

    python -m deepinfer.testing.random_model llama-8b --cache-dir .bench-models   # optional: else the shape's config is written
    PYTHONPATH=shared:. python bench/spec/spec_oracle_gpu.py [--model-dir .bench-models/llama-8b] [--concurrency 1,16,64,256]
                                    [--alphas 0.6,0.8,0.9] [--k 3] [--prompt-len 128] [--max-tokens 128] [--out F]
    PYTHONPATH=shared:. python bench/spec/spec_oracle_gpu.py --quick [--dtype bfloat16]   # a tiny model on the CPU: the code paths in seconds

Prints progress, then a table; writes JSON to --out (default $OUT/spec-oracle-gpu.json when OUT is set), its commit
GIT_COMMIT when set (the device copy's git may not know the tree's), else git's HEAD.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.drafter import Draft
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.random_model import MAX_POSITION_EMBEDDINGS, SHAPES

#: The default model's vocabulary, as deepinfer.testing.random_model's shapes.
VOCAB_SIZE = 49152
#: --quick: a two-layer toy on the CPU.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
#: The speculating engine is built for "auto" (drafts of up to 8 tokens: its logits budget), then given the oracle
#: with the draft length of each mode.
BUILT_FOR = {"method": "ngram", "num_speculative_tokens": "auto"}


#: --residual-scale: what the layers' output projections are multiplied by in the successor model.
RESIDUAL_SCALE = 1e-4


def successor_permutation(vocab_size: int, seed: int = 0) -> list[int]:
    """pi: the successor model's next token of each token (a random permutation of the vocabulary)."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()


def make_successor(engine: EngineCore, permutation: list[int], residual_scale: float) -> None:
    """Turn the engine's random model into the successor model of `permutation` (module docstring), in place (the
    captured CUDA graphs read the same storage)."""
    model = engine.runner.model
    if model.lm_head is None:
        raise SystemExit("the successor model needs an untied lm_head (tie_word_embeddings: false)")
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    inverse = torch.argsort(torch.tensor(permutation)).to(embed.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(residual_scale)
        head.zero_()
        head[: embed.shape[0]].copy_(embed[inverse])  # row pi(t) = embedding of t


def successor_walk(permutation: list[int], token: int, length: int) -> list[int]:
    """pi(token), pi(pi(token)), ...: the successor model's greedy continuation."""
    walk = []
    for _ in range(length):
        token = permutation[token]
        walk.append(token)
    return walk


class SuccessorDrafter:
    """Drafts the successor model's next tokens from the request's own last token, each kept with probability
    `alpha` and otherwise replaced by another token (never the right one). Benchmark-only."""

    has_probs = False

    def __init__(self, permutation: list[int], alpha: float, seed: int = 0) -> None:
        self.permutation, self.alpha = permutation, alpha
        self.rng = random.Random(seed)

    def propose(self, request, num_tokens: int) -> Draft:
        """The next num_tokens of the pi-walk, each wrong with probability 1 - alpha."""
        rand, alpha, vocab = self.rng.random, self.alpha, len(self.permutation)
        return Draft(
            [
                t if rand() < alpha else (t + 1 + int(rand() * (vocab - 1))) % vocab
                for t in successor_walk(self.permutation, request.all_token_ids[-1], num_tokens)
            ]
        )


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, exactly max_tokens new tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)


def run_batch(engine: EngineCore, prompts: list[list[int]], tag: str, max_tokens: int) -> dict:
    """Add every prompt at once, step to the end: tokens per request, tok/s per user (decode) and total."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first, last = {}, {}
    params = greedy(max_tokens)
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            if o.new_token_ids:
                tokens[o.request_id] += o.new_token_ids
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    wall_s = time.perf_counter() - start
    per_user = [(len(tokens[r]) - 1) / (last[r] - first[r]) for r in ids if last[r] > first[r]]
    return {
        "tokens": [tokens[r] for r in ids],
        "wall_s": wall_s,
        "per_user_tok_s": statistics.mean(per_user) if per_user else 0.0,
        "total_tok_s": sum(map(len, tokens.values())) / wall_s,
    }


def reps_at(concurrency: int, quick: bool) -> int:
    """Timed runs per point: fewer where one run is long (and its mean over many requests already steady)."""
    return 1 if quick or concurrency >= 64 else 3 if concurrency == 1 else 2


def measure(
    engine: EngineCore,
    prompts: list[list[int]],
    tag: str,
    max_tokens: int,
    reps: int,
    reference: list[list[int]] | None,
) -> dict:
    """A short warm-up batch (16 tokens), then `reps` timed ones: the best rates, the acceptance counters of the
    timed runs, and how many sequences parted from `reference`."""
    run_batch(engine, prompts, f"{tag}-warm", min(16, max_tokens))
    before = engine.spec_decode_stats
    before = (
        before.num_drafts,
        before.num_draft_tokens,
        before.num_accepted_tokens,
        list(before.num_accepted_tokens_per_pos),
    )
    runs = [run_batch(engine, prompts, f"{tag}-{r}", max_tokens) for r in range(reps)]
    stats = engine.spec_decode_stats
    drafts, drafted, accepted = (
        stats.num_drafts - before[0],
        stats.num_draft_tokens - before[1],
        stats.num_accepted_tokens - before[2],
    )
    per_pos = [
        n - (before[3][i] if i < len(before[3]) else 0)
        for i, n in enumerate(stats.num_accepted_tokens_per_pos)
    ]
    row = {
        "per_user_tok_s": round(max(r["per_user_tok_s"] for r in runs), 1),
        "total_tok_s": round(max(r["total_tok_s"] for r in runs), 1),
        "wall_s": round(min(r["wall_s"] for r in runs), 3),
        "reps": reps,
        "num_requests": len(prompts),
    }
    if drafts:
        row |= {
            "num_drafts": drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 2),
            "accepted_per_pos": [round(n / drafts, 3) for n in per_pos],
        }
    if reference is not None:
        parted = [
            next((i for i, (a, b) in enumerate(zip(t, ref, strict=False)) if a != b), None)
            for r in runs
            for t, ref in zip(r["tokens"], reference, strict=True)
        ]
        row["diverged"] = sum(p is not None for p in parted)
        row["first_divergence"] = min((p for p in parted if p is not None), default=None)
        # The share of output tokens before their sequence parted: the part of the run drafted at the known alpha.
        lengths = [len(t) for r in runs for t in r["tokens"]]
        row["on_reference"] = round(
            sum(n if p is None else p for p, n in zip(parted, lengths, strict=True)) / max(1, sum(lengths)), 3
        )
    row["tokens"] = runs[0]["tokens"]
    return row


def make_engine(
    model_dir: Path, device: str, dtype: str, speculative: bool, max_model_len: int, permutation: list[int],
    residual_scale: float, execution_mode: str | None = None,
) -> EngineCore:
    """An engine over the config alone (load_format="dummy", the same seed: every engine holds one model), its
    model made the successor model of `permutation` (execution_mode None: the default)."""
    args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        enable_prefix_caching=False,
        enable_kv_events=False,
        progress=False,
        gpu_memory_utilization=0.9,
        kv_host_cache_bytes=0,
        speculative_config=BUILT_FOR if speculative else None,
        **({} if execution_mode is None else {"execution_mode": execution_mode}),
    )
    engine = EngineCore(args)
    make_successor(engine, permutation, residual_scale)
    if engine.device.type == "cuda":
        for cache in engine.runner.kv_caches:  # random KV (never zeros), as bench/gpu.py
            cache.normal_(0, 1)
    gc.collect()
    gc.freeze()
    return engine


def model_config_dir(args: argparse.Namespace, tmp: Path) -> Path:
    """--model-dir when it holds a config.json, else the shape's config written into tmp (no tokenizer needed:
    prompts are token ids)."""
    if not args.quick and (args.model_dir / "config.json").is_file():
        return args.model_dir
    shape = TINY if args.quick else SHAPES["llama-8b"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(".bench-models/llama-8b"))
    parser.add_argument("--concurrency", help="default 1,16,64,256 (--quick: 1,4)")
    parser.add_argument("--alphas", help="default 0.6,0.8,0.9 (--quick: 0.8)")
    parser.add_argument("--k", type=int, default=3, help="the fixed draft length")
    parser.add_argument("--prompt-len", type=int, help="default 128 (--quick: 16)")
    parser.add_argument("--max-tokens", type=int, help="default 128 (--quick: 24)")
    parser.add_argument("--quick", action="store_true", help="a tiny random model on the CPU, float32")
    parser.add_argument("--dtype", help="default bfloat16 (--quick: float32)")
    parser.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE,
                        help="the successor model's factor on o_proj and down_proj")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name, full, quick in (
        ("concurrency", "1,16,64,256", "1,4"),
        ("alphas", "0.6,0.8,0.9", "0.8"),
        ("prompt_len", 128, 16),
        ("max_tokens", 128, 24),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    device, dtype = ("cpu", "float32") if args.quick else ("cuda", "bfloat16")
    dtype = args.dtype or dtype
    if args.quick:
        torch.set_num_threads(1)  # shared cores: OpenMP spinning on two threads only adds noise
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    modes = [args.k, "auto"]
    out = args.out or (Path(os.environ["OUT"]) / "spec-oracle-gpu.json" if os.environ.get("OUT") else None)
    started = time.perf_counter()
    # GIT_COMMIT first (as scripts/gpu_tests.sh): the device machine's copy of the tree may have no git, or a
    # repository whose HEAD is not the tree's (two H200 runs of 2026-12-04 recorded c77db6b for 62c4d98 and f5b85b1).
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            commit = ""
    res: dict = {
        "bench": "spec_oracle_gpu",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "config": {
            "concurrency": concurrencies,
            "alphas": alphas,
            "k": args.k,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "quick": args.quick,
            "dtype": dtype,
            "residual_scale": args.residual_scale,
        },
        "build_s": {},
        "rows": [],
    }

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    def save() -> None:
        if out is not None:
            out.write_text(
                json.dumps(
                    {**res, "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in res["rows"]]},
                    indent=1,
                )
            )

    def add(row: dict) -> None:
        res["rows"].append(row)
        log(
            f"{row['mode']:>9} alpha={row['alpha']} c={row['concurrency']:<3} {row['per_user_tok_s']:8.1f} tok/s "
            f"per user {row['total_tok_s']:9.1f} total  acceptance={row.get('acceptance_rate', '-')} "
            f"diverged={row.get('diverged', '-')} on_reference={row.get('on_reference', '-')}"
        )
        save()

    prompts = {
        c: np.random.default_rng(c).integers(0, VOCAB_SIZE, (c, args.prompt_len)).tolist()
        for c in concurrencies
    }
    max_model_len = args.prompt_len + args.max_tokens + 64
    permutation = successor_permutation(VOCAB_SIZE)
    references = {c: [successor_walk(permutation, p[-1], args.max_tokens) for p in prompts[c]] for c in concurrencies}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_config_dir(args, Path(tmp))
        log(f"building the plain engine ({model_dir})")
        t0 = time.perf_counter()
        engine = make_engine(model_dir, device, dtype, False, max_model_len, permutation, args.residual_scale)
        res["build_s"]["plain"] = round(time.perf_counter() - t0, 1)
        log(f"plain engine built in {res['build_s']['plain']} s (async scheduling {engine.async_scheduling})")
        for c in concurrencies:
            add(
                {
                    "mode": "none",
                    "alpha": None,
                    "concurrency": c,
                    **measure(
                        engine,
                        prompts[c],
                        f"none-{c}",
                        args.max_tokens,
                        reps_at(c, args.quick),
                        references[c],
                    ),
                }
            )
        gc.unfreeze()  # make_engine froze it: its cycles must be collectable for its memory to go back
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        log("building the speculating engine")
        t0 = time.perf_counter()
        engine = make_engine(model_dir, device, dtype, True, max_model_len, permutation, args.residual_scale)
        res["build_s"]["speculative"] = round(time.perf_counter() - t0, 1)
        log(f"speculating engine built in {res['build_s']['speculative']} s")
        engine.install_drafter(None)
        for c in concurrencies:
            add(
                {
                    "mode": "none-sync",
                    "alpha": None,
                    "concurrency": c,
                    **measure(
                        engine,
                        prompts[c],
                        f"sync-{c}",
                        args.max_tokens,
                        reps_at(c, args.quick),
                        references[c],
                    ),
                }
            )
        for alpha in alphas:
            for mode in modes:
                engine.install_drafter(SuccessorDrafter(permutation, alpha, seed=int(alpha * 100)), mode)
                for c in concurrencies:
                    tag = f"{mode}-{alpha}-{c}"
                    row = {
                        "mode": f"k={mode}" if mode != "auto" else "auto",
                        "alpha": alpha,
                        "concurrency": c,
                        **measure(
                            engine, prompts[c], tag, args.max_tokens, reps_at(c, args.quick), references[c]
                        ),
                    }
                    if (
                        mode != "auto"
                    ):  # position i is tried when the i before it were accepted: alpha^(i+1) each
                        row["expected_acceptance_rate"] = round(
                            sum(alpha ** (i + 1) for i in range(mode)) / mode, 3
                        )
                    add(row)
    res["elapsed_s"] = round(time.perf_counter() - started, 1)
    save()
    print_table(res)


def print_table(res: dict) -> None:
    """Per alpha and concurrency: tok/s per user and total of each mode, speed-ups against none."""
    rows = res["rows"]
    none = {r["concurrency"]: r for r in rows if r["mode"] == "none"}
    sync = {r["concurrency"]: r for r in rows if r["mode"] == "none-sync"}
    spec_modes = sorted({r["mode"] for r in rows if r["alpha"] is not None}, key=lambda m: m == "auto")
    print(
        f"\n{res['device']}, {res['config']['prompt_len']}-token prompts, {res['config']['max_tokens']} tokens, "
        f"greedy; per user (decode) / total tok/s; xN = per user against none; built {res['build_s']} s; "
        f"{res.get('elapsed_s')} s in all"
    )
    header = f"{'alpha':>5} {'c':>4} | {'none':>15} | {'none-sync':>15} |" + "".join(
        f" {m:>36} |" for m in spec_modes
    )
    print(header)
    print("-" * len(header))
    for alpha in sorted({r["alpha"] for r in rows if r["alpha"] is not None}):
        for c in sorted(none):
            line = f"{alpha:>5} {c:>4} | {_rate(none[c]):>15} | {_rate(sync.get(c)):>15} |"
            for m in spec_modes:
                r = next(
                    (r for r in rows if r["mode"] == m and r["alpha"] == alpha and r["concurrency"] == c),
                    None,
                )
                if r is None:
                    line += f" {'-':>36} |"
                    continue
                cell = (
                    f"{_rate(r)} x{r['per_user_tok_s'] / none[c]['per_user_tok_s']:.2f} "
                    f"a{r.get('acceptance_rate', 0):.2f} d{r.get('diverged', 0)} r{r.get('on_reference', 1):.2f}"
                )
                line += f" {cell:>36} |"
            print(line)
    print(
        "a = accepted / draft tokens of the timed runs; d = sequences whose tokens parted from the successor "
        "model's pi-walk (0: the run emitted exactly the target's greedy tokens); r = share of output tokens before "
        "they parted"
    )
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


def _rate(row: dict | None) -> str:
    return "-" if row is None else f"{row['per_user_tok_s']:.0f}/{row['total_tok_s']:.0f}"


if __name__ == "__main__":
    main()
