"""Host time the offline `LLM` adds to each engine step (detokenization, stop strings, logprobs, output objects),
on the CPU, with the engine replaced by a stand-in that costs (almost) nothing and is timed apart.

    PYTHONPATH=shared:. python bench/gpu/llm_host_overhead.py [--batch 64] [--max-tokens 256] [--stop] [--logprobs 0]

The stand-in engine (`ReplayEngine`) gives every running sequence one token per step, read from a fixed English
text's token ids under the default model's tokenizer (SmolLM2-135M-Instruct, from the model cache; each sequence
starts at its own offset), and ends it at max_tokens (ignore_eos). What is timed is `LLM.generate` minus the
stand-in's `step()` (process CPU time, which other processes on a shared machine leave out), per step: what the
LLM's loop adds to every engine step in series with it. `--stop` gives every request two stop strings that never
match (the stop checks run, the text is never cut); `--logprobs k` asks top-k logprobs (their decoded tokens).
Prints ms per step and one JSON line, with a digest of every output (text, token ids, finish and stop reasons,
logprobs) so runs of two commits can be checked for identical outputs. The stand-in engine goes in through
`LLM.from_engine` (commits before it: this file as of e1b3d3c, which set the LLM's private fields itself).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
from pathlib import Path

from deepinfer.engine.llm import LLM
from deepinfer.engine.outputs import EngineOutput, SampledToken
from deepinfer.protocol import FinishReason
from deepinfer.sampling.params import SamplingParams
from deepinfer.tokenizer import Tokenizer

#: Generated text the stand-in engine replays (mixed prose, code, numbers and non-ASCII characters).
TEXT = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()[:20000] + (
    " Grüße aus Zürich — naïve café, 東京 と 大阪, emoji 🙂🚀, ∑ x² ≤ ∞. " * 20
)


class ReplayEngine:
    """Stands in for `Engine`: one token per running sequence per step from a fixed stream, LENGTH at max_tokens.
    `step()`'s own process time is summed in `step_s` (the bench leaves it out)."""

    def __init__(self, tokenizer: Tokenizer, logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.generation_config: dict = {}
        self.stream = tokenizer.encode(TEXT, add_special_tokens=False)
        self.logprobs = logprobs
        self.running: dict[str, list] = {}  # request_id -> [max_tokens, tokens so far, offset]
        self.step_s = 0.0
        self.num_steps = 0

    def check_request(self, request) -> None:
        """Every request is valid."""

    def add_request(self, request) -> None:
        """Run it from the next step, at its own offset in the stream."""
        offset = (len(self.running) * 37 + int(request.request_id.split("-")[0]) * 101) % (len(self.stream) - 4096)
        self.running[request.request_id] = [request.sampling_params.max_tokens, 0, offset]

    def abort(self, request_ids) -> None:
        """Drop them."""
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while a sequence runs."""
        return bool(self.running)

    def step(self) -> list[EngineOutput]:
        """One token for every running sequence."""
        start = time.process_time()
        outputs, stream, k, done = [], self.stream, self.logprobs, []
        for request_id, state in self.running.items():
            max_tokens, num, offset = state
            token_id = stream[offset + num]
            state[1] = num = num + 1
            finished = num >= max_tokens
            if finished:
                done.append(request_id)
            top = [(stream[offset + num + j], -1.0 - j) for j in range(k)] if k else None
            logprobs = [SampledToken(token_id, -0.5, top)] if k is not None else None
            outputs.append(EngineOutput(request_id, [token_id], logprobs, FinishReason.LENGTH if finished else None,
                                        None, 0))
        for request_id in done:
            del self.running[request_id]
        self.num_steps += 1
        self.step_s += time.process_time() - start
        return outputs


def make_llm(tokenizer: Tokenizer, logprobs: int | None) -> tuple[LLM, ReplayEngine]:
    """An LLM over the stand-in engine (no model load)."""
    engine = ReplayEngine(tokenizer, logprobs)
    return LLM.from_engine(engine), engine


def digest(outputs) -> str:
    """A hash of everything the outputs say (text, ids, reasons, logprobs with their decoded tokens)."""
    h = hashlib.sha256()
    for o in outputs:
        for c in o.outputs:
            lps = None if c.logprobs is None else [sorted((t, lp.logprob, lp.rank, lp.decoded_token)
                                                          for t, lp in d.items()) for d in c.logprobs]
            h.update(repr((o.request_id, c.index, c.text, c.token_ids, str(c.finish_reason), c.stop_reason,
                           lps)).encode())
    return h.hexdigest()[:16]


def measure(batch: int, max_tokens: int, stop: bool, logprobs: int | None, repeats: int) -> dict:
    """Median host ms per step of the LLM's loop (outside the engine's step) over `repeats` generate calls."""
    from deepinfer.defaults import default_model_cache_dir
    from deepinfer.model_store import resolve_model

    tokenizer = Tokenizer.from_dir(resolve_model(None, default_model_cache_dir(), progress=False))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                            stop=["@@never-one@@", "\n\n\n\n\n\n"] if stop else None)
    prompts = [{"prompt_token_ids": [1 + i % 50, 2, 3]} for i in range(batch)]
    gc.collect()
    gc.freeze()
    per_step, per_step_wall, digests = [], [], set()
    for _ in range(repeats + 1):  # the first is a warm-up
        llm, engine = make_llm(tokenizer, logprobs)
        start, wall = time.process_time(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        cpu, wall = time.process_time() - start, time.perf_counter() - wall
        per_step.append((cpu - engine.step_s) / engine.num_steps)
        per_step_wall.append((wall - engine.step_s) / engine.num_steps)
        digests.add(digest(outputs))
    assert len(digests) == 1, digests
    return {"batch": batch, "max_tokens": max_tokens, "stop": stop, "logprobs": logprobs,
            "llm_cpu_ms_per_step": round(1e3 * statistics.median(per_step[1:]), 3),
            "llm_wall_ms_per_step": round(1e3 * statistics.median(per_step_wall[1:]), 3),
            "runs_cpu_ms": [round(1e3 * s, 3) for s in per_step[1:]], "outputs_digest": digests.pop()}


def main() -> None:
    """Print ms per step, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stop", action="store_true", help="two stop strings per request (never matched)")
    parser.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    res = measure(args.batch, args.max_tokens, args.stop, args.logprobs, args.repeats)
    print(f"LLM host ms/step outside the engine at B={res['batch']}: {res['llm_cpu_ms_per_step']} (cpu), "
          f"{res['llm_wall_ms_per_step']} (wall); outputs {res['outputs_digest']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
