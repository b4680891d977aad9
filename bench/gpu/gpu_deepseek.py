"""DeepSeek-V2-Lite shape (MLA + 64-expert MoE), random bf16 weights, on one device (`python bench/gpu/gpu.py
--model deepseek`): prefill and decode tok/s of our engine (CUDA graphs and eager) beside transformers'
DeepseekV2ForCausalLM from the same config.json, a decode roofline over the bytes a step must read (weights,
routed experts actually touched, latent KV) and the ceilings measured in the same run.

Reads gpu.py's --sections (ceilings, prefill, decode, hf; the rest are Llama-only), --layers, --out, --tiny
(shrinks the config and lengths and runs on the CPU: it checks the code paths, its numbers mean nothing) and
--hf-compile (let transformers auto-compile its static-cache decode; off by default: compiling 27 MoE layers
does not fit the run's budget).
Each section lands in the JSON ($OUT/gpu-deepseek-bench.json or --out) as soon as it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from bench.gpu.gpu_decode import CONTEXT, decode_ours, kernel_profile, replay_ms, top_kernels
from bench.gpu.gpu_hf import hf_decode, hf_prefill
from bench.gpu.harness import ceilings, guarded, prefill_ours

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
    "scoring_func": "softmax", "max_position_embeddings": 163840,
    # transformers 5.x spelling (rope_theta inside); our ModelConfig reads it and the 4.x `rope_scaling` alike.
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}
#: --tiny: the same architecture at toy size (ids inside the small vocabulary).
TINY_OVERRIDES = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1,
}
#: Without a measured ceiling (--tiny, or no ceilings section), ANCHORS.md's H200 figures.
H200_CEILINGS = {"matmul_tflops": 741.0, "copy_gb_s": 3979.0}


@dataclass(frozen=True)
class Shape:
    """Where and at which lengths the bench runs."""

    device: str
    prefill_seqs: int
    prefill_len: int
    #: (batch, timed engine steps) for our decode; its context is gpu_decode.CONTEXT.
    ours_decode: tuple[tuple[int, int], ...]
    #: (batch, new tokens) for transformers' decode after a `hf_context`-token prompt.
    hf_decode: tuple[tuple[int, int], ...]
    hf_context: int
    max_model_len: int


FULL = Shape("cuda", 4, 2048, ((1, 64), (64, 48)), ((1, 32), (64, 16)), CONTEXT, 4096)
TINY = Shape("cpu", 2, 64, ((1, 8), (64, 4)), ((1, 4), (64, 2)), 128, 4096)


@contextlib.contextmanager
def host_sync_noop(device: torch.device):
    """On the CPU, gpu.timed and gpu_decode.decode_ours call torch.cuda.synchronize: make it a no-op there."""
    if device.type == "cuda":
        yield
        return
    with mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None):
        yield


def make_deepseek_engine(model_dir: Path, shape: Shape):
    """Our engine over the config alone (load_format="dummy"), CUDA graphs on where there is CUDA."""
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    max_num_seqs = max(b for b, _ in shape.ours_decode)
    on_cpu = shape.device == "cpu"
    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16", device=shape.device,
                      max_model_len=shape.max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=shape.prefill_seqs * shape.prefill_len, enable_kv_events=False,
                      progress=False, gpu_memory_utilization=0.9, kv_cache_bytes=(256 << 20) if on_cpu else None)
    start = time.perf_counter()
    engine = EngineCore(args)
    for cache in engine.runner.kv_caches:  # random latent KV (never zeros): decode reads it at full width
        cache.normal_(0, 1)
    return engine, time.perf_counter() - start


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts hit by B tokens routed uniformly and independently to top-k of E."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def weight_split(model) -> dict:
    """Bytes/params of the routed experts per MoE layer, of everything else but the embedding table, and lm_head."""
    routed, dense, routed_params, dense_params, lm_head_params, moe_layers = 0, 0, 0, 0, 0, set()
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            routed, routed_params = routed + p.numel() * p.element_size(), routed_params + p.numel()
            moe_layers.add(name.rsplit(".mlp.", 1)[0])
        elif "embed_tokens" not in name and not name.startswith("mtp_layers"):
            dense, dense_params = dense + p.numel() * p.element_size(), dense_params + p.numel()
            lm_head_params += p.numel() if name.startswith("lm_head") else 0
    n = max(len(moe_layers), 1)
    return {"dense_bytes": dense, "routed_bytes_per_layer": routed // n, "num_moe_layers": len(moe_layers),
            "dense_params": dense_params, "routed_params_per_layer": routed_params // n,
            "lm_head_params": lm_head_params}


def decode_roofline(engine, split: dict, batch: int, context: float, copy_gb_s: float) -> dict:
    """tok/s if a decode step read only what it must at the copy bandwidth (see ROOFLINE_FORMULA)."""
    moe = engine.model_config.moe
    distinct = expected_distinct_experts(moe.num_experts, moe.num_experts_per_tok, batch)
    experts = split["num_moe_layers"] * distinct * split["routed_bytes_per_layer"] / moe.num_experts
    kv = engine.model_config.kv_bytes_per_token(engine.dtype) * batch * context
    total = split["dense_bytes"] + experts + kv
    return {"tok_s": round(batch * copy_gb_s * 1e9 / total, 1), "step_gb": round(total / 1e9, 3),
            "dense_gb": round(split["dense_bytes"] / 1e9, 3), "experts_gb": round(experts / 1e9, 3),
            "kv_gb": round(kv / 1e9, 3), "distinct_experts_per_layer": round(distinct, 2), "context": context}


ROOFLINE_FORMULA = ("bytes/step = W_dense (all weights but embeddings and routed experts: attention, dense MLP, "
                    "shared experts, routers, norms, lm_head) + L_moe * D(B) * W_expert + kv_bytes_per_token * B * ctx; "
                    "D(B) = E * (1 - (1 - k/E)^B) expected distinct routed experts per MoE layer (uniform, "
                    "independent top-k; D(1) = k); tok/s = B * copy GB/s / bytes; ctx = mean over the timed steps")


def prefill_limit(engine, split: dict, shape: Shape, tflops: float) -> tuple[float, str]:
    """Seconds for the cold prefill at the measured matmul rate: active linear + causal MLA attention FLOPs."""
    cfg = engine.model_config
    moe, mla = cfg.moe, cfg.mla
    active = (split["dense_params"] - split["lm_head_params"]
              + split["num_moe_layers"] * moe.num_experts_per_tok * split["routed_params_per_layer"] / moe.num_experts)
    seqs, seq_len = shape.prefill_seqs, shape.prefill_len
    tokens, pairs = seqs * seq_len, seqs * seq_len * (seq_len + 1) // 2
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) * pairs
    flops = 2 * active * tokens + 2 * split["lm_head_params"] * seqs + attn
    formula = ("(2*N_active*T + 2*N_lm_head*S + 2*L*Hq*(D_qk+D_v)*sum_s S_s(S_s+1)/2) / matmul rate; "
               f"N_active={active / 1e9:.3f}e9 (top-{moe.num_experts_per_tok} of {moe.num_experts} routed + shared "
               f"+ attention + dense), T={tokens}, {flops / 1e12:.2f} TFLOP")
    return flops / (tflops * 1e12), formula


def ours_decode(engine, split: dict, batch: int, steps: int, res: dict, save) -> None:
    """Decode `batch` requests at CONTEXT tokens: graphs (CUDA) and eager, beside the roofline of that batch."""
    rng = np.random.default_rng(batch)
    graph = decode_ours(engine, rng, batch, steps, eager=False) if engine.runner.graphs is not None else None
    eager = decode_ours(engine, rng, batch, steps, eager=True)
    roof = decode_roofline(engine, split, batch, CONTEXT + 3 + steps / 2, res["ceilings"]["copy_gb_s"])
    row = {"context": CONTEXT, "steps": steps, "eager_tok_s": eager["tok_s"], "eager_step_ms": eager["step_ms"],
           "roofline_tok_s": roof["tok_s"], "roofline": roof}
    if graph is not None:
        row.update(graphs_tok_s=graph["tok_s"], graphs_step_ms=graph["step_ms"],
                   graph_replay_ms=round(replay_ms(engine, batch, CONTEXT + 3 + steps), 3),
                   graphs_of_roofline=round(graph["tok_s"] / roof["tok_s"], 3),
                   graphs_phases_ms={k: v for k, v in graph.items() if k.endswith("_ms") and k != "step_ms"})
    res.setdefault("decode", {})[str(batch)] = row
    save()


def ours_prefill(engine, split: dict, shape: Shape, res: dict, save) -> None:
    """Cold prefill, all prompts in one engine step, beside its matmul-rate limit."""
    seconds = prefill_ours(engine, np.random.default_rng(0), num_seqs=shape.prefill_seqs, seq_len=shape.prefill_len)
    limit_s, formula = prefill_limit(engine, split, shape, res["ceilings"]["matmul_tflops"])
    tokens = shape.prefill_seqs * shape.prefill_len
    res.setdefault("prefill", {}).update(ours_tok_s=round(tokens / seconds, 1), ours_s=round(seconds, 4),
                                         limit_tok_s=round(tokens / limit_s, 1), limit_formula=formula)
    save()


def run_ours(model_dir: Path, shape: Shape, sections: set, res: dict, save) -> None:
    """Our engine, built once (freed on return): cold prefill and decode at B = 1 and 64."""
    engine, build_s = make_deepseek_engine(model_dir, shape)
    split = weight_split(engine.runner.model)
    moe = engine.model_config.moe
    active = split["dense_params"] + split["num_moe_layers"] * moe.num_experts_per_tok * split[
        "routed_params_per_layer"] / moe.num_experts
    res["ours"] = {"build_s": round(build_s, 1), "kv_cache_tokens": engine.kv_plan.num_tokens,
                   "kv_bytes_per_token": engine.model_config.kv_bytes_per_token(engine.dtype),
                   "weights_gb": round((split["dense_bytes"] + split["num_moe_layers"]
                                        * split["routed_bytes_per_layer"]) / 1e9, 2),
                   "active_params_per_token_b": round(active / 1e9, 3)}
    if engine.runner.graphs is not None:
        res["ours"].update(capture_sizes=engine.runner.graphs.sizes,
                           seq_len_buckets=engine.runner.graphs.seq_len_buckets)
    save()
    if "prefill" in sections:
        guarded(res, "ours_prefill_error", lambda: ours_prefill(engine, split, shape, res, save))
    if "decode" in sections:
        res["roofline_formula"] = ROOFLINE_FORMULA
        for batch, steps in shape.ours_decode:
            guarded(res, f"ours_decode_{batch}_error",
                    lambda b=batch, n=steps: ours_decode(engine, split, b, n, res, save))
    if "profile" in sections and engine.device.type == "cuda":
        rng = np.random.default_rng(3)
        for batch in (1, 64):
            guarded(res, f"profile_{batch}_error", lambda b=batch: res.setdefault("profile", {}).update(
                {str(b): kernel_profile(engine, rng, b)}))
            save()
        guarded(res, "profile_prefill_error", lambda: res.setdefault("profile", {}).update(
            prefill=prefill_profile(engine, rng, shape)))
        save()


def prefill_profile(engine, rng, shape: Shape) -> dict:
    """Top CUDA kernels of the cold prefill step (two steps: timed()'s warm-up and one rep)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_ours(engine, rng, reps=1, num_seqs=shape.prefill_seqs, seq_len=shape.prefill_len)
    return top_kernels(prof, steps=2)


def hf_model(model_dir: Path, device: str) -> tuple[torch.nn.Module, str]:
    """transformers' DeepseekV2ForCausalLM from the same config, random bf16 weights; sdpa, else eager."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)

    def build(attn: str) -> torch.nn.Module:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                  attn_implementation=attn)
        return model.eval()

    try:
        return build("sdpa"), "sdpa"
    except (ValueError, ImportError, NotImplementedError):  # transformers refuses sdpa for this model
        return build("eager"), "eager"


def hf_decode_any_cache(model, vocab: int, batch: int, new_tokens: int, shape: Shape, compile_decode: bool) -> dict:
    """Static cache when transformers' DeepseekV2 takes it; else the default dynamic cache (the error recorded)."""
    kwargs = {"context": shape.hf_context, "device": shape.device, "compile_decode": compile_decode}
    try:
        return hf_decode(model, vocab, batch, new_tokens, cache="static", **kwargs)
    except Exception as exc:  # noqa: BLE001 - any refusal of the static cache falls back, and says why
        static_error = f"{type(exc).__name__}: {exc}"[:500]
    gc.collect()
    if shape.device == "cuda":
        torch.cuda.empty_cache()
    return {**hf_decode(model, vocab, batch, new_tokens, cache=None, **kwargs), "static_error": static_error}


def hf_prefill_section(model, shape: Shape, res: dict, save) -> None:
    """transformers' prefill over the same shape as ours."""
    seconds = hf_prefill(model, model.config.vocab_size, num_seqs=shape.prefill_seqs, seq_len=shape.prefill_len,
                         device=shape.device)
    tokens = shape.prefill_seqs * shape.prefill_len
    res.setdefault("prefill", {}).update(transformers_tok_s=round(tokens / seconds, 1),
                                         transformers_s=round(seconds, 4))
    save()


def hf_decode_section(model, batch: int, new_tokens: int, shape: Shape, res: dict, save, compile_decode: bool):
    """transformers' decode at one batch size, into res["transformers_decode"][batch]."""
    row = hf_decode_any_cache(model, model.config.vocab_size, batch, new_tokens, shape, compile_decode)
    res.setdefault("transformers_decode", {})[str(batch)] = row
    save()


def run_hf(model_dir: Path, shape: Shape, sections: set, res: dict, save, compile_decode: bool) -> None:
    """transformers on the same config (freed on return): prefill, then decode at each of shape.hf_decode."""
    start = time.perf_counter()
    model, attn = hf_model(model_dir, shape.device)
    res["transformers"] = {"attn_implementation": attn, "build_s": round(time.perf_counter() - start, 1),
                           "experts_implementation": getattr(model.config, "_experts_implementation", None),
                           "compile_decode": compile_decode}
    save()
    if "prefill" in sections:
        guarded(res, "transformers_prefill_error", lambda: hf_prefill_section(model, shape, res, save))
    if "decode" in sections:
        for batch, new_tokens in shape.hf_decode:
            guarded(res, f"transformers_decode_{batch}_error",
                    lambda b=batch, n=new_tokens: hf_decode_section(model, b, n, shape, res, save, compile_decode))


def print_table(res: dict) -> None:
    """One line per measured figure."""
    c, o = res.get("ceilings", {}), res.get("ours", {})
    print(f"ceilings: matmul {c.get('matmul_tflops')} TFLOP/s, copy {c.get('copy_gb_s')} GB/s (read+write)"
          f"{'' if res.get('ceilings_measured') else '  [not measured: H200 anchors]'}")
    print(f"model: {res.get('model')}; weights {o.get('weights_gb')} GB, active {o.get('active_params_per_token_b')}"
          f"e9 params/token, KV {o.get('kv_bytes_per_token')} B/token; transformers "
          f"{res.get('transformers', {}).get('attn_implementation')} attention, experts "
          f"{res.get('transformers', {}).get('experts_implementation')}")
    p = res.get("prefill", {})
    if p:
        print(f"prefill {res['shape']['prefill_seqs']}x{res['shape']['prefill_len']} cold, tok/s: ours "
              f"{p.get('ours_tok_s')}  transformers {p.get('transformers_tok_s')}  limit {p.get('limit_tok_s')}"
              f"   [{p.get('limit_formula')}]")
    print(f"{'decode B':>8} {'ctx':>5} {'graphs':>9} {'eager':>9} {'replay ms':>9} {'roofline':>9} {'of roof':>7} "
          f"{'GB/step':>8} {'experts':>7} {'transformers':>12} {'hf cache':>8}")
    hf_rows = res.get("transformers_decode", {})
    for batch in sorted(set(res.get("decode", {})) | set(hf_rows), key=int):
        d, hf = res.get("decode", {}).get(batch, {}), hf_rows.get(batch, {})
        roof = d.get("roofline", {})
        print(f"{batch:>8} {d.get('context', '-'):>5} {d.get('graphs_tok_s', '-'):>9} {d.get('eager_tok_s', '-'):>9} "
              f"{d.get('graph_replay_ms', '-'):>9} {d.get('roofline_tok_s', '-'):>9} "
              f"{d.get('graphs_of_roofline', '-'):>7} {roof.get('step_gb', '-'):>8} "
              f"{roof.get('distinct_experts_per_layer', '-'):>7} {hf.get('tok_s', '-'):>12} {hf.get('cache', '-'):>8}")
    if res.get("roofline_formula"):
        print(f"roofline: {res['roofline_formula']}")
    for batch, prof in res.get("profile", {}).items():
        what = "prefill" if batch == "prefill" else f"eager decode B={batch}"
        print(f"{what}: {prof['device_ms_per_step']} device ms/step; top kernels (ms/step, calls): "
              + "; ".join(f"{k['name'][:48]} {k['ms_per_step']} ({k['calls_per_step']})" for k in prof["top_kernels"]))
    for key, value in res.items():
        if key.endswith("_error"):
            print(f"{key}: {value.strip().splitlines()[-1]}")


def main_deepseek(args: argparse.Namespace) -> None:
    """Ceilings, our engine, then transformers; table, then one JSON line (bench/gpu/gpu.py --model deepseek)."""
    shape = TINY if args.tiny else FULL
    sections = set(args.sections.split(",")) & {"ceilings", "prefill", "decode", "hf", "profile"}
    cfg = {**DEEPSEEK_V2_LITE, **(TINY_OVERRIDES if args.tiny else {})}
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    out = args.out or (Path(os.environ["OUT"]) / "gpu-deepseek-bench.json" if os.environ.get("OUT") else None)
    device = torch.device(shape.device)
    import transformers

    res: dict = {"bench": "gpu-deepseek", "model": f"DeepSeek-V2-Lite shape{' (tiny)' if args.tiny else ''}, "
                 f"{cfg['num_hidden_layers']} layers, random bf16", "tiny": args.tiny,
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "transformers_version": transformers.__version__,
                 "date": time.strftime("%Y-%m-%d"), "sections": sorted(sections), "shape": asdict(shape)}

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(res, indent=1))

    res.update(ceilings=dict(H200_CEILINGS), ceilings_measured=False)
    if device.type == "cuda" and "ceilings" in sections:
        guarded(res, "ceilings_error", lambda: res.update(ceilings=ceilings(), ceilings_measured=True))
        torch.cuda.empty_cache()  # the engine plans its KV cache from the free memory
    save()
    with tempfile.TemporaryDirectory() as tmp, host_sync_noop(device):
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(cfg))
        if sections & {"prefill", "decode"}:
            guarded(res, "ours_error", lambda: run_ours(model_dir, shape, sections, res, save))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "hf" in sections:
            guarded(res, "transformers_error",
                    lambda: run_hf(model_dir, shape, sections, res, save, args.hf_compile))
        save()
    print_table(res)
    print(json.dumps(res))
