"""`deepinfer generate`: the offline engine from the command line (prompts as arguments or one per stdin line)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `deepinfer generate` (vLLM's names)."""
    parser.add_argument("prompts", nargs="*", help="prompts; none = read one prompt per line from stdin")
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or known name (default model)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")


def run(args: argparse.Namespace) -> int:
    """Load the model, generate for every prompt, print the completions."""
    from deepinfer.engine.llm import LLM
    from deepinfer.sampling.params import SamplingParams

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("deepinfer generate: no prompt given (arguments or stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop,
        )
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"deepinfer generate: {exc}", file=sys.stderr)
        return 2
    for prompt, output in zip(prompts, outputs, strict=True):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "num_cached_tokens": output.num_cached_tokens,
                "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in output.outputs],
            }))
        else:
            for completion in output.outputs:
                print(completion.text.strip() if args.chat else prompt + completion.text)
    return 0
