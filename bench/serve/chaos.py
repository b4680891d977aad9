"""Chaos harness: a steady load against `deepinfer up` (2 prefill + 2 decode workers) while faults are injected one
at a time; every completed answer is compared with the same request served without faults.

    PYTHONPATH=shared:. python bench/serve/chaos.py                          # 100 faults or 30 min, whichever comes first
    PYTHONPATH=shared:. python bench/serve/chaos.py --faults 12 --concurrency 3 --only kill-decode,stop-decode

Bounded (--faults, --duration-s) and loopback only: it starts its own stack on 127.0.0.1 and stops it at the end.
The stack has `--schedulers` replicas (2 by default, as the chart): with one, killing it is an outage by design.
The load: `--concurrency` clients (the official openai SDK, its default retries of 503s as users run it; `--retries 0`
counts every 503 the service gives as a failure), each
looping over a fixed set of requests — greedy and seeded temperature 0.8, streamed and not, `ignore_eos` with
`--max-tokens`. The faults, round robin, each followed by a wait until the stack is ready and a fresh request
succeeds (the recovery time): kill -9 and SIGSTOP (for `--stop-s`) of a decode, prefill and scheduler process,
a nats-server kill -9 (the supervisor restarts it), a client disconnect storm (streams dropped after a few chunks)
and a SIGTERM drain of a decode worker. At the end: requests attempted / completed / failed, tokens lost and
duplicated (a completed text against its fault-free text, token by token), recovery times, gateway re-issues,
and what the workers still hold once the load stopped (running requests, KV blocks, leases): the leak check.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from deepinfer.config import CommonSettings
from deepinfer.model_store import resolve_model
from deepinfer.tokenizer import Tokenizer
from deepinfer.up import Stack

PROMPTS = [
    "Tell me about the history of Paris.",
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "List some facts about the moon.",
]
FAULTS = ("kill-decode", "stop-decode", "kill-prefill", "stop-prefill", "kill-scheduler", "restart-nats",
          "disconnect-storm", "drain-decode")
STACK_ENV = {"DEEPINFER_GATEWAY_API_KEYS": "", "OMP_NUM_THREADS": "1", "DEEPINFER_SCHEDULER_WORKER_LEASE_S": "2",
             "DEEPINFER_GATEWAY_WORKER_LEASE_S": "2", "DEEPINFER_DECODE_DRAIN_GRACE_S": "1"}


@dataclass(frozen=True)
class Job:
    """One request of the load: its prompt, sampling and mode."""

    prompt: str
    sampling: tuple[tuple[str, object], ...]
    stream: bool

    def body(self, model: str, max_tokens: int) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": self.prompt}], "max_tokens": max_tokens,
                "extra_body": {"ignore_eos": True}, **dict(self.sampling)}


@dataclass
class Tally:
    """What the load saw."""

    attempted: int = 0
    completed: int = 0
    failed: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    mismatched: int = 0
    #: A few (fault-free text, text) pairs that differ, for the report.
    samples: list[tuple[str, str]] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def jobs() -> list[Job]:
    greedy, seeded = (("temperature", 0),), (("temperature", 0.8), ("seed", 4321))
    return [Job(p, s, stream) for p in PROMPTS for s in (greedy, seeded) for stream in (True, False)]


def ask(client: openai.OpenAI, job: Job, model: str, max_tokens: int) -> str:
    """The answer's text (streamed ones joined); an openai error when the request failed."""
    body = job.body(model, max_tokens)
    if not job.stream:
        return client.chat.completions.create(**body).choices[0].message.content or ""
    text = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return text


def token_diff(tokenizer: Tokenizer, expected: str, got: str) -> tuple[int, int]:
    """(tokens of `expected` missing from `got`, tokens of `got` not in `expected`), aligned by difflib."""
    a, b = tokenizer.encode(expected, add_special_tokens=False), tokenizer.encode(got, add_special_tokens=False)
    lost = duplicated = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            lost += i2 - i1
        if tag in ("insert", "replace"):
            duplicated += j2 - j1
    return lost, duplicated


def load_loop(client, model, max_tokens, references, tokenizer, tally: Tally, stop: threading.Event, rng) -> None:
    """One client: requests one after the other until `stop`."""
    order = list(references)
    while not stop.is_set():
        job = rng.choice(order)
        with tally.lock:
            tally.attempted += 1
        try:
            text = ask(client, job, model, max_tokens)
        except openai.APIError as exc:
            with tally.lock:
                tally.failed += 1
                tally.errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            continue
        lost, duplicated = (0, 0) if text == references[job] else token_diff(tokenizer, references[job], text)
        with tally.lock:
            tally.completed += 1
            tally.tokens_lost += lost
            tally.tokens_duplicated += duplicated
            if text != references[job]:
                tally.mismatched += 1
                if len(tally.samples) < 5:
                    tally.samples.append((references[job], text))


def inject(stack: Stack, fault: str, index: int, stop_s: float) -> str:
    """Inject one fault; returns its target."""
    kind, _, role = fault.partition("-")
    if fault == "restart-nats":
        stack.kill("nats", signal.SIGKILL)
        return "nats"
    if fault == "disconnect-storm":
        disconnect_storm(stack)
        return "gateway-0"
    target = f"{role}-{index % (stack.num_schedulers if role == 'scheduler' else 2)}"
    if kind == "kill":
        stack.kill(target, signal.SIGKILL)
    elif kind == "drain":
        stack.kill(target, signal.SIGTERM)
    else:
        stack.kill(target, signal.SIGSTOP)
        time.sleep(stop_s)
        with contextlib.suppress(Exception):  # the supervisor may have replaced it meanwhile
            stack.kill(target, signal.SIGCONT)
    return target


def disconnect_storm(stack: Stack, num_streams: int = 8) -> None:
    """Streams opened at once and dropped after a few chunks."""
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 200,
            "stream": True, "ignore_eos": True}

    def one() -> None:
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"{stack.base_url}/chat/completions", json=body, timeout=30) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    return

    threads = [threading.Thread(target=one) for _ in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def recover(stack: Stack, client: openai.OpenAI, started_s: float, timeout_s: float = 180) -> float:
    """Seconds from the fault until the stack is ready and a fresh request succeeds."""
    stack.wait_ready(timeout_s)
    probe = Job(PROMPTS[0], (("temperature", 0),), False)
    while time.monotonic() - started_s < timeout_s:
        with contextlib.suppress(openai.APIError):
            ask(client, probe, stack.model_name, 2)
            return time.monotonic() - started_s
        time.sleep(0.2)
    raise TimeoutError("the stack did not recover")


def held(stack: Stack) -> dict[str, float]:
    """Totals over the workers: running and waiting requests, KV blocks in use, prefill leases held."""
    totals: Counter = Counter()
    for name, service in stack.services.items():
        if not name.startswith(("prefill-", "decode-")):
            continue
        text = httpx.get(f"http://127.0.0.1:{service.internal_port}/metrics", timeout=5).text
        sample = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("deepinfer_worker_") and " " in line}
        totals["running"] += sample.get("deepinfer_worker_running_requests", 0)
        totals["waiting"] += sample.get("deepinfer_worker_waiting_requests", 0)
        totals["leases"] += sample.get("deepinfer_worker_held_leases", 0)
        totals["blocks_in_use"] += (sample.get("deepinfer_worker_total_blocks", 0)
                                    - sample.get("deepinfer_worker_free_blocks", 0))
    return dict(totals)


def reissues(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.services['gateway-0'].internal_port}/metrics", timeout=5).text
    return {kind: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() for kind in ("start", "migration")
            if line.startswith(f'deepinfer_gateway_reissues_total{{kind="{kind}"}}')}


def run(args: argparse.Namespace) -> dict:
    faults = [f for f in FAULTS if not args.only or f in args.only.split(",")]
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": args.data_dir or tempfile.mkdtemp(prefix="chaos-")}
    with Stack(port=0, env_overrides=env, start_timeout_s=300, num_prefill=2, num_decode=2,
               num_schedulers=args.schedulers) as stack:
        tokenizer = Tokenizer.from_dir(resolve_model(stack.model, CommonSettings().model_cache_dir, False))
        client = openai.OpenAI(base_url=stack.base_url, api_key="chaos", timeout=120, max_retries=args.retries)
        references = {job: ask(client, job, stack.model_name, args.max_tokens) for job in jobs()}
        tally, stop = Tally(), threading.Event()
        clients = [threading.Thread(target=load_loop, args=(client, stack.model_name, args.max_tokens, references,
                                                             tokenizer, tally, stop, random.Random(args.seed + i)))
                   for i in range(args.concurrency)]
        for thread in clients:
            thread.start()
        injected: Counter = Counter()
        recovery: dict[str, list[float]] = {}
        deadline_s = time.monotonic() + args.duration_s
        try:
            for index in range(args.faults):
                if time.monotonic() > deadline_s:
                    break
                time.sleep(args.interval_s)
                fault = faults[index % len(faults)]
                started_s = time.monotonic()
                target = inject(stack, fault, index // len(faults), args.stop_s)
                injected[fault] += 1
                recovery.setdefault(fault, []).append(recover(stack, client, started_s))
                print(f"[{index + 1}] {fault} ({target}): recovered in {recovery[fault][-1]:.1f} s; "
                      f"{tally.completed}/{tally.attempted} completed, {tally.failed} failed", flush=True)
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=180)
        time.sleep(args.settle_s)  # the last heartbeats report what is still held
        return {"faults": dict(injected), "recovery_s": recovery, "attempted": tally.attempted,
                "completed": tally.completed, "failed": tally.failed, "tokens_lost": tally.tokens_lost,
                "tokens_duplicated": tally.tokens_duplicated, "mismatched": tally.mismatched,
                "errors": dict(tally.errors), "differing_samples": tally.samples, "held_after": held(stack), "reissues": reissues(stack)}


def table(result: dict) -> str:
    rows = [("fault", "injected", "recovery s (median / max)")]
    for fault, times in result["recovery_s"].items():
        rows.append((fault, str(len(times)), f"{statistics.median(times):.1f} / {max(times):.1f}"))
    lines = [f"{a:<18} {b:>8}  {c}" for a, b, c in rows]
    lines += [
        "",
        f"faults injected      {sum(result['faults'].values())}",
        f"requests attempted   {result['attempted']}",
        f"requests completed   {result['completed']}",
        f"requests failed      {result['failed']}",
        f"texts differing      {result['mismatched']}",
        f"tokens lost          {result['tokens_lost']}",
        f"tokens duplicated    {result['tokens_duplicated']}",
        f"gateway re-issues    {result['reissues']}",
        f"held after the run   {result['held_after']}  (leak check: all 0)",
    ]
    lines += [f"  error x{n}: {e}" for e, n in result["errors"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100, help="faults to inject (round robin over the kinds)")
    parser.add_argument("--duration-s", type=float, default=1800, help="stop injecting after this long")
    parser.add_argument("--only", default="", help=f"comma-separated fault kinds of {','.join(FAULTS)}")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--schedulers", type=int, default=2,
                        help="scheduler replicas (default 2, as the chart runs them: one is a single point of failure)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--interval-s", type=float, default=2.0, help="pause after a recovery")
    parser.add_argument("--stop-s", type=float, default=4.0, help="how long a SIGSTOP lasts")
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait after the load before the leak check")
    parser.add_argument("--retries", type=int, default=2, help="the openai client's max_retries (its default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default="", help="DEEPINFER_DATA_DIR of the stack (default: its own)")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    result = run(args)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["failed"] == 0 and result["tokens_lost"] == result["tokens_duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
