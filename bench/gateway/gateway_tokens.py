"""The gateway's CPU per streamed token, by stage.

    PYTHONPATH=shared:. python bench/gateway/gateway_tokens.py [--streams 256] [--steps 256]

Each decode step delivers one TokenBatch with a chunk for every stream (as a decode worker sends it); the
gateway demultiplexes it (`TokenStreams.on_batch`), each stream takes its chunk (`RequestStream.get`),
detokenizes and checks stop strings (`ChoiceOutput.add`) and formats the SSE event (`StreamFormatter.delta`).
Timed on one core with `time.process_time`, HTTP and the bus left out. Prints a table and one JSON line. (Its
first version also timed the pydantic event path each event took before the per-token one, through a private
method of the presenter: `git show 0cc667b:bench/gateway/gateway_tokens.py`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from deepinfer.protocol import TokenBatch, TokenChunk, WireSamplingParams
from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.output import ChoiceOutput
from services.gateway.presenters import CHAT
from services.gateway.recipe import ModelInfo
from services.gateway.streams import TokenStreams

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


async def run(num_streams: int, num_steps: int) -> dict[str, float]:
    """CPU µs per token in each stage."""
    model = ModelInfo.from_dir(write_tokenizer_dir(Path(tempfile.mkdtemp()) / "tok"), "m")
    token_ids = model.tokenizer.encode(TEXT, add_special_tokens=False)[:num_steps]
    streams = TokenStreams(FakeBus(FakeBroker()), "m", "gw")
    ids = [f"r{i}" for i in range(num_streams)]
    opened = [streams.open(request_id) for request_id in ids]
    sampling = WireSamplingParams(stop=["never appears"])
    outputs = [ChoiceOutput(0, model.tokenizer, [1, 2, 3], sampling) for _ in ids]
    generation = SimpleNamespace(response_id="chatcmpl-x", created=0, model_name="m", include_usage=False,
                                 logprobs=False, top_logprobs=False, tokenizer=model.tokenizer, outputs=outputs[:1],
                                 rules=None)
    formatter = CHAT.stream(generation)
    spent = {"demux": 0.0, "get": 0.0, "detokenize": 0.0, "format": 0.0}
    for step, token_id in enumerate(token_ids):
        batch = TokenBatch(worker_id="d", step=step, chunks=[TokenChunk(request_id=r, token_ids=[token_id]) for r in ids])
        started = time.process_time()
        await streams.on_batch(batch)
        spent["demux"] += time.process_time() - started
        for stream, output in zip(opened, outputs, strict=True):
            t0 = time.process_time()
            chunk = await stream.get(0.25)
            t1 = time.process_time()
            delta = output.add(chunk)
            t2 = time.process_time()
            formatter.delta(delta)
            t3 = time.process_time()
            spent["get"] += t1 - t0
            spent["detokenize"] += t2 - t1
            spent["format"] += t3 - t2
    num_tokens = num_streams * len(token_ids)
    return {stage: round(seconds / num_tokens * 1e6, 2) for stage, seconds in spent.items()}


def main() -> None:
    """Both variants, a table and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    results = {"per-token": asyncio.run(run(args.streams, args.steps))}
    stages = list(results["per-token"])
    print(f"gateway CPU per token (µs), {args.streams} streams x {args.steps} steps")
    print(f"{'variant':<12}" + "".join(f"{s:>12}" for s in stages) + f"{'total':>12}{'tok/s/core':>12}")
    for name, by_stage in results.items():
        total = sum(by_stage.values())
        print(f"{name:<12}" + "".join(f"{by_stage[s]:>12.2f}" for s in stages) + f"{total:>12.2f}{1e6 / total:>12.0f}")
    print(json.dumps({"bench": "gateway_tokens", "streams": args.streams, "steps": args.steps, **{
        name: {**by_stage, "total_us": round(sum(by_stage.values()), 2)} for name, by_stage in results.items()}}))


if __name__ == "__main__":
    main()
