"""The gateway's per-token output work (`ChoiceOutput.add`: incremental detokenization, stop strings, the text so
far) against how long the output already is, on this CPU.

    PYTHONPATH=shared:. python bench/gateway/detok_cost.py [--tokens 16384]

One choice, the default model's tokenizer, an English text fed one token per chunk (as a decode worker that
keeps up sends it); µs per token over each range of output positions. Prints one JSON line. Run it on two
checkouts (PYTHONPATH) to compare: a cost that grows with the position is a copy of the whole output per token.
"""

from __future__ import annotations

import argparse
import json
import time

from deepinfer.config import CommonSettings
from deepinfer.model_store import resolve_model
from deepinfer.protocol import TokenChunk, WireSamplingParams
from deepinfer.tokenizer import Tokenizer
from services.gateway.output import ChoiceOutput

TEXT = "The ocean covers most of the planet, and its depths hold creatures that glow in the dark. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(resolve_model(None, CommonSettings().model_cache_dir, False))
    ids: list[int] = []
    while len(ids) < args.tokens:
        ids += tokenizer.encode(TEXT * 200, add_special_tokens=False)
    chunks = [TokenChunk(request_id="r", token_ids=[token_id]) for token_id in ids[: args.tokens]]
    output = ChoiceOutput(0, tokenizer, [], WireSamplingParams(max_tokens=None))
    edges = [n for n in (1024, 2048, 4096, 8192, 16384, 32768, 65536) if n <= args.tokens]
    ranges, start, started_s = {}, 0, time.perf_counter()
    for position, chunk in enumerate(chunks, 1):
        output.add(chunk)
        if position in edges:
            now_s = time.perf_counter()
            ranges[f"{start}-{position}"] = round((now_s - started_s) / (position - start) * 1e6, 2)
            start, started_s = position, now_s
    print(json.dumps({"bench": "detok_cost", "us_per_token": ranges}))


if __name__ == "__main__":
    main()
