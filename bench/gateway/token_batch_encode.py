"""Event-loop CPU of one step's TokenBatch encoding, per way of writing it, at a number of running requests.

    PYTHONPATH=shared:. python bench/gateway/token_batch_encode.py [--chunks 1 64 256] [--repeats 7] [--out FILE]

A steady decode step: every request gained one token, none is new, none finished, no logprobs (the chunks the
worker writes all but twice per request). µs per step, the least of `--repeats` timings of many steps (other
processes only ever add to a cost):

    models   TokenChunk / TokenBatch (pydantic), then to_bytes (the worker before session 3)
    fields   token_chunk_fields dicts, then encode_token_batch (one msgpack packb of the batch)
    writer   TokenBatchWriter.add_steady per chunk from a per-request prefix, then close (one b"".join)

Every way gives the same bytes (checked here; tests/unit/test_token_wire.py checks every kind of chunk).
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

from deepinfer.protocol import (
    TokenBatch,
    TokenBatchWriter,
    TokenChunk,
    chunk_prefix,
    encode_token_batch,
    token_chunk_fields,
)

WORKER = "decode-7f3a9c"


def _requests(num_chunks: int) -> list[tuple[str, bytes, list[int], int]]:
    """(request id as the gateway names it, its prefix, this step's token ids, tokens before them)."""
    ids = [f"chatcmpl-{n:032x}" for n in range(num_chunks)]
    return [(rid, chunk_prefix(rid), [1000 + 37 * n % 120_000], 200 + n) for n, rid in enumerate(ids)]


def ways(num_chunks: int):
    requests = _requests(num_chunks)
    writer = TokenBatchWriter(WORKER)

    def models() -> bytes:
        chunks = [TokenChunk(request_id=rid, token_ids=ids, num_previous_tokens=prev) for rid, _, ids, prev in requests]
        return TokenBatch(worker_id=WORKER, step=12345, chunks=chunks).to_bytes()

    def fields() -> bytes:
        chunks = [token_chunk_fields(rid, ids, num_previous_tokens=prev) for rid, _, ids, prev in requests]
        return encode_token_batch(WORKER, 12345, chunks)

    def written() -> bytes:
        pieces = writer.open()
        for _, prefix, ids, prev in requests:
            writer.add_steady(pieces, prefix, ids, prev)
        return writer.close(pieces, 12345)

    return {"models": models, "fields": fields, "writer": written}


def measure(num_chunks: int, repeats: int) -> dict[str, float]:
    found = ways(num_chunks)
    expected = found["models"]()
    assert all(way() == expected for way in found.values()), "a way wrote other bytes"
    result = {}
    for name, way in found.items():
        number = max(20, 20_000 // max(num_chunks, 1))
        result[name] = round(1e6 * min(timeit.repeat(way, number=number, repeat=repeats)) / number, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    points = [{"chunks": n, "us_per_step": measure(n, args.repeats)} for n in args.chunks]
    print("chunks | " + " | ".join(points[0]["us_per_step"]) + "   (µs per step, least of repeats)")
    for p in points:
        print(f"{p['chunks']} | " + " | ".join(str(v) for v in p["us_per_step"].values()))
    line = json.dumps({"bench": "token_batch_encode", "repeats": args.repeats, "points": points})
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
