"""Offline throughput: our engine vs `transformers.generate` on the same prompts, same weights, same run.

    PYTHONPATH=shared:. python bench/serve/offline.py [--num-prompts 64] [--max-tokens 64] [--device cpu] [--model NAME_OR_PATH]

Prints a table and one JSON line. Both sides generate exactly --max-tokens tokens per prompt (ignore_eos /
min_new_tokens), greedily, so the work is identical; prompts are chat-templated questions of varied length.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

TOPICS = [
    "the water cycle", "how a compiler works", "the French revolution", "photosynthesis", "black holes",
    "the history of tea", "how vaccines work", "plate tectonics", "the stock market", "machine learning",
    "the Roman empire", "how bicycles stay upright", "coral reefs", "the printing press", "jazz music",
    "quantum computing",
]
STYLES = ["Explain {t} to a child.", "Write three facts about {t}.", "Give a short summary of {t}.",
          "What are common misconceptions about {t}? Answer in detail, with examples and a conclusion."]


def make_conversations(num_prompts: int) -> list[list[dict]]:
    """Deterministic, varied chat prompts."""
    return [
        [{"role": "user", "content": STYLES[i % len(STYLES)].format(t=TOPICS[(i * 7) % len(TOPICS)])}]
        for i in range(num_prompts)
    ]


def run_ours(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds and generated tokens for our engine."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model_dir, prompts: list[list[int]], max_tokens: int, device, dtype, batch_size: int):
    """Seconds and generated tokens for transformers.generate (left-padded batches, sdpa)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
        generated += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - start, generated


def main() -> None:
    """Run both sides and print the table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepinfer import LLM

    llm = LLM(args.model, device=args.device, progress=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in make_conversations(args.num_prompts)]
    run_ours(llm, prompts[:2], 4)  # warm-up
    ours_s, ours_tokens = run_ours(llm, prompts, args.max_tokens)
    hf_s, hf_tokens = run_transformers(
        llm.engine.model_dir, prompts, args.max_tokens, llm.engine.device, llm.engine.core.dtype, args.hf_batch_size
    )
    rows = [("deepinfer", ours_s, ours_tokens), ("transformers.generate", hf_s, hf_tokens)]
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"{args.num_prompts} prompts ({prompt_tokens} prompt tokens), {args.max_tokens} new tokens each, "
          f"device={llm.engine.device}, dtype={llm.engine.core.dtype}, threads={torch.get_num_threads()}")
    print(f"{'engine':<24}{'seconds':>10}{'out tok':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for name, seconds, tokens in rows:
        print(f"{name:<24}{seconds:>10.2f}{tokens:>10}{tokens / seconds:>12.1f}{(tokens + prompt_tokens) / seconds:>13.1f}")
    result = {
        "bench": "offline",
        "model": str(llm.engine.model_dir.name),
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.core.dtype),
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "prompt_tokens": prompt_tokens,
        "max_tokens": args.max_tokens,
        "ours_output_tok_s": round(ours_tokens / ours_s, 1),
        "transformers_output_tok_s": round(hf_tokens / hf_s, 1),
        "speedup": round((ours_tokens / ours_s) / (hf_tokens / hf_s), 2),
        "host": platform.node(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
