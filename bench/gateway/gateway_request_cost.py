"""The gateway's CPU per request before routing, by stage, for a long chat prompt: JSON parse, body validation, chat
template, tokenize, SamplingParams (the workers' validation too) and block hashes.

    PYTHONPATH=shared:. python bench/gateway/gateway_request_cost.py MODEL_DIR [--tokens 8192] [--repeat 20]

MODEL_DIR: a Hugging Face model directory (tokenizer.json, tokenizer_config.json with a chat template, config.json).
Timed on one core with `time.process_time`, median of `--repeat` runs; prints a table and one JSON line. Grammar
compilation (response_format) is not part of this branch's pipeline and is not measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic_core

from deepinfer.hashing import hash_blocks
from services.gateway.presenters import CHAT
from services.gateway.recipe import ModelInfo, chat_text, sampling_params

BLOCK_SIZE = 16
FINGERPRINT = b"\x07" * 32


def _body(model: ModelInfo, num_tokens: int) -> bytes:
    """A chat request whose prompt is about `num_tokens` tokens long."""
    sentence = "The quick brown fox jumps over the lazy dog near the riverbank at dawn. "
    text = sentence
    while len(model.tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += sentence * 16
    return json.dumps({
        "model": model.served_model_name, "max_tokens": 64, "temperature": 0.7, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
    }).encode()


def _time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    samples, result = [], None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    model = ModelInfo.from_dir(args.model_dir, "bench", max_model_len=args.tokens * 2)
    raw = _body(model, args.tokens)
    stages: dict[str, float] = {}
    stages["json_parse"], data = _time(lambda: pydantic_core.from_json(raw, allow_inf_nan=False), args.repeat)
    stages["validate_body"], body = _time(lambda: CHAT.parse(data), args.repeat)
    stages["chat_template"], text = _time(lambda: chat_text(model, body), args.repeat)
    stages["tokenize"], ids = _time(lambda: model.tokenizer.encode(text, add_special_tokens=False), args.repeat)
    stages["sampling_params"], _ = _time(lambda: sampling_params(model, body, len(ids), 64, None), args.repeat)
    stages["block_hashes"], _ = _time(lambda: hash_blocks(ids, BLOCK_SIZE, FINGERPRINT, "salt"), args.repeat)
    total = sum(stages.values())
    print(f"{len(raw) / 1024:.0f} KiB body, {len(ids)} prompt tokens, median of {args.repeat} (process CPU)")
    for name, seconds in stages.items():
        print(f"  {name:16s} {seconds * 1000:8.2f} ms")
    print(f"  {'total':16s} {total * 1000:8.2f} ms")
    print(json.dumps({"prompt_tokens": len(ids), "body_bytes": len(raw),
                      **{f"{k}_ms": round(v * 1000, 3) for k, v in stages.items()}, "total_ms": round(total * 1000, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
