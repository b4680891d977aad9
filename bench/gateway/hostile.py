"""What a hostile or naive client gets from a `deepinfer up` stack (issue #40), one case per subcommand.

    PYTHONPATH=shared:. python bench/gateway/hostile.py prompt      # 15.6 MB prompts on /tokenize, /v1/completions, /v1/chat/completions
                                        # while a second client sends small requests
    PYTHONPATH=shared:. python bench/gateway/hostile.py schemas     # impossible and pathological JSON schemas
    PYTHONPATH=shared:. python bench/gateway/hostile.py integer     # {"population": {"type": "integer"}} at temperature 0
    PYTHONPATH=shared:. python bench/gateway/hostile.py scheduler   # a scheduler killed under 8 streaming clients
    PYTHONPATH=shared:. python bench/gateway/hostile.py abandon     # a 6,000-token prompt abandoned 2 s in, then a small request
    PYTHONPATH=shared:. python bench/gateway/hostile.py defaults    # 80 SDK-default chat answers to the France question
    PYTHONPATH=shared:. python bench/gateway/hostile.py defaults --env DEEPINFER_GATEWAY_SAMPLING_DEFAULTS=openai   # as before #40

Each starts its own stack (the default model, CPU; `--schedulers`), prints one line per measurement and a JSON
line at the end. Figures: docs/hostile-clients.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from deepinfer.testing.background import BackgroundClient
from deepinfer.up import Stack

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BIG_PROMPT_CHARS = 15_600_000
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def rss_mb(pid: int | None) -> float:
    """Resident memory of a process (MB), 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def wait_healthy(base: str, timeout_s: float) -> None:
    """Until the gateway answers /health with 200 (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def summary(outcomes: list[tuple[object, float]]) -> dict[str, Any]:
    """A background client's requests: how many, how many failed (not a 200), the slowest."""
    failed = [status for status, _ in outcomes if status != 200]
    return {
        "num_requests": len(outcomes),
        "num_failed": len(failed),
        "failures": sorted({str(status) for status in failed}),
        "max_latency_s": round(max((seconds for _, seconds in outcomes), default=0.0), 2),
    }


def case_prompt(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Huge prompts on each route while a second client's small completions run."""
    base = stack.base_url.removesuffix("/v1")
    model = stack.model_name
    text = "hello world " * (BIG_PROMPT_CHARS // 12)
    bodies = {
        "/tokenize": {"model": model, "prompt": text},
        "/v1/completions": {"model": model, "prompt": text, "max_tokens": 4},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4},
    }
    # Under the character bound: tokenized (~150k tokens, a second or two), then refused for its tokens.
    near = ("hello world, this is a prompt " * 22_000)[:660_000]
    bodies["/v1/completions 660k chars"] = {"model": model, "prompt": near, "max_tokens": 4}
    payloads = {route: json.dumps(body).encode() for route, body in bodies.items()}
    small = httpx.Client(base_url=base, timeout=30)

    def small_request() -> int:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        return small.post("/v1/completions", json=body).status_code

    gateway_pid = stack.services["gateway-0"].pid
    results: dict[str, Any] = {"gateway_rss_mb_before": round(rss_mb(gateway_pid))}
    peak = [0.0]
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss_mb(stack.services["gateway-0"].pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    with BackgroundClient(small_request, pause_s=0.2) as background, httpx.Client(base_url=base, timeout=60) as big:
        time.sleep(1.0)
        for name, payload in payloads.items():
            route = name.split()[0]
            started = time.monotonic()
            try:
                response = big.post(route, content=payload, headers={"content-type": "application/json"})
                outcome: Any = {"status": response.status_code, "body": response.text[:300]}
            except httpx.HTTPError as exc:
                outcome = {"status": type(exc).__name__}
            outcome["seconds"] = round(time.monotonic() - started, 2)
            results[name] = outcome
            print(f"{name}: {outcome}", flush=True)
            wait_healthy(base, 60)  # a killed gateway is back before the next route is tried
        time.sleep(2.0)
    sampling.set()
    sampler.join()
    results["small_requests"] = summary(background.outcomes)
    results["gateway_rss_mb_peak"] = round(peak[0])
    results["gateway_replaced"] = stack.services["gateway-0"].pid != gateway_pid
    results["gateway_restarts"] = stack.restart_count("gateway-0")
    print(f"small requests: {results['small_requests']}", flush=True)
    print(f"gateway RSS before {results['gateway_rss_mb_before']} MB, peak {results['gateway_rss_mb_peak']} MB, "
          f"replaced: {results['gateway_replaced']}", flush=True)
    return results


def unique_prompt(num_words: int, seed: int) -> str:
    """A prompt no cache holds: numbered words from a seeded generator (~4 tokens per word)."""
    rng = random.Random(seed)
    words = ["river", "stone", "market", "violet", "engine", "harbor", "lantern", "meadow", "copper", "falcon"]
    return " ".join(f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(num_words))


def case_abandon(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """A client abandons a long uncached prompt 2 s in (streamed or not); how long the next small request takes."""
    base = stack.base_url.removesuffix("/v1")
    model = stack.model_name
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    client.completions.create(model=model, prompt="Hello", max_tokens=2)  # warm
    runs = []
    for run in range(args.runs):
        prompt = unique_prompt(args.prompt_words, seed=time.time_ns() + run)
        num_tokens = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": prompt}).json()["count"]
        stream = run % 2 == 0
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": stream}
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: its connection closes
            httpx.post(f"{base}/v1/completions", json=body, timeout=args.abandon_after_s)
        started = time.monotonic()
        client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
        seconds = round(time.monotonic() - started, 2)
        runs.append({"prompt_tokens": num_tokens, "stream": stream, "next_request_s": seconds})
        print(f"run {run}: {num_tokens}-token prompt abandoned after {args.abandon_after_s} s "
              f"({'stream' if stream else 'no stream'}): next small request took {seconds} s", flush=True)
        time.sleep(1.0)
    return {"runs": runs, "max_next_request_s": max(r["next_request_s"] for r in runs)}


def case_scheduler(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """8 clients stream short completions; scheduler-0 is killed; what the requests of the next 15 s get."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
    model = stack.model_name
    outcomes: list[tuple[float, str]] = []
    stop = threading.Event()

    def stream_one() -> str:
        try:
            stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, stream=True)
            for _ in stream:
                pass
            return "ok"
        except openai.APIStatusError as exc:
            return str(exc.status_code)
        except openai.APIError as exc:
            return type(exc).__name__

    def run() -> None:
        while not stop.is_set():
            outcome = stream_one()
            outcomes.append((time.monotonic(), outcome))

    threads = [threading.Thread(target=run, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(5.0)
    killed_s = time.monotonic()
    stack.kill("scheduler-0", signal.SIGKILL)
    time.sleep(15.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    before = [o for t, o in outcomes if killed_s - 5.0 <= t < killed_s]
    after = [o for t, o in outcomes if t >= killed_s and t < killed_s + 15.0]
    failed = [o for o in after if o != "ok"]
    result = {"num_schedulers": stack.num_schedulers, "num_requests_5s_before": len(before),
              "num_requests": len(after), "num_failed": len(failed),
              "failures": sorted(set(failed)), "scheduler_restarts": stack.restart_count("scheduler-0")}
    print(f"scheduler-0 killed under 8 streaming clients ({stack.num_schedulers} replicas): "
          f"{len(failed)} of {len(after)} requests of the next 15 s failed {sorted(set(failed))}", flush=True)
    return result


#: Schemas no document satisfies, or whose document is pathological (issue #40, 2).
SCHEMAS: dict[str, dict[str, Any]] = {
    "$ref loop": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "recursive required $ref": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "pattern ^a{100000}$": {"type": "string", "pattern": "^a{100000}$"},
    "pattern ^(x{1000}){1000}$": {"type": "string", "pattern": "^(x{1000}){1000}$"},
    "minimum > maximum": {"type": "integer", "minimum": 5, "maximum": 1},
}
#: What an error message must never carry: the grammar engine's internal state.
INTERNALS = ("<state>", "grm_prefix", "compute_time_us", "lexer_cost", "Parser: {")


def schema_request(model: str, schema: dict[str, Any], max_tokens: int | None = None) -> dict[str, Any]:
    """A chat completion body asking for `schema`."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def case_schemas(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Each schema of SCHEMAS: status, error type and message (or finish_reason), seconds; internals leaked?"""
    base = stack.base_url.removesuffix("/v1")
    results = {}
    for name, schema in SCHEMAS.items():
        started = time.monotonic()
        response = httpx.post(f"{base}/v1/chat/completions", json=schema_request(stack.model_name, schema),
                              timeout=600)
        body = response.json()
        outcome: dict[str, Any] = {"status": response.status_code, "seconds": round(time.monotonic() - started, 2)}
        if "error" in body:
            outcome.update(type=body["error"]["type"], message=body["error"]["message"][:200])
        else:
            choice = body["choices"][0]
            outcome.update(finish_reason=choice["finish_reason"], completion_tokens=body["usage"]["completion_tokens"])
        outcome["leaks_internals"] = any(marker in response.text for marker in INTERNALS)
        results[name] = outcome
        print(f"{name}: {outcome}", flush=True)
    return results


def case_integer(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """An unbounded integer property at temperature 0: how the document ends."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=600)
    results = {}
    for closed in (True, False):
        schema: dict[str, Any] = {"type": "object", "properties": {"population": {"type": "integer"}},
                                  "required": ["population"]}
        if closed:
            schema["additionalProperties"] = False
        for question in ("What is the population of Paris?", "How many people live in Tokyo?"):
            messages = [{"role": "user", "content": f"{question} Answer in JSON."}]
            started = time.monotonic()
            reply = client.chat.completions.create(
                model=stack.model_name, messages=messages, temperature=0, max_tokens=args.max_tokens,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            )
            choice = reply.choices[0]
            result = {"finish_reason": choice.finish_reason, "completion_tokens": reply.usage.completion_tokens,
                      "seconds": round(time.monotonic() - started, 2), "text": choice.message.content[:100]}
            name = f"{'closed' if closed else 'open'} object, {question}"
            results[name] = result
            print(f"{name}: {result}", flush=True)
    return results


def case_defaults(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """80 chat answers to the France question with the SDK's defaults (no temperature): how many name Paris."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=600)
    card = client.models.list().data[0]
    texts: list[str] = []
    lock = threading.Lock()

    def ask(num: int) -> None:
        reply = client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=32, n=num)
        with lock:
            texts.extend(choice.message.content or "" for choice in reply.choices)

    threads = [threading.Thread(target=ask, args=(8,)) for _ in range(args.samples // 8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    num_paris = sum("Paris" in text for text in texts)
    result = {"default_sampling_params": card.model_extra.get("default_sampling_params"),
              "num_samples": len(texts), "num_paris": num_paris, "examples": texts[:3]}
    print(f"defaults {result['default_sampling_params']}: {num_paris} of {len(texts)} answers name Paris; "
          f"e.g. {texts[:2]}", flush=True)
    return result


CASES: dict[str, Callable[[Stack, argparse.Namespace], dict[str, Any]]] = {
    "defaults": case_defaults,
    "schemas": case_schemas,
    "integer": case_integer,
    "scheduler": case_scheduler,
    "prompt": case_prompt,
    "abandon": case_abandon,
}


def main() -> None:
    """Start a stack, run one case, print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--schedulers", type=int, default=None, help="scheduler replicas (default: up's)")
    parser.add_argument("--runs", type=int, default=4, help="abandon: prompts abandoned, streamed every other one")
    parser.add_argument("--prompt-words", type=int, default=1500, help="abandon: words of each prompt (~4 tokens each)")
    parser.add_argument("--samples", type=int, default=80, help="defaults: answers drawn (8 per request)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for every service (e.g. DEEPINFER_GATEWAY_SAMPLING_DEFAULTS=openai)")
    parser.add_argument("--max-tokens", type=int, default=None, help="integer: max_tokens (default: the context)")
    parser.add_argument("--abandon-after-s", type=float, default=2.0, help="abandon: when the client gives up")
    args = parser.parse_args()
    kwargs = {} if args.schedulers is None else {"num_schedulers": args.schedulers}
    env = {"DEEPINFER_GATEWAY_API_KEYS": "", **dict(item.split("=", 1) for item in args.env)}
    with Stack(port=0, env_overrides=env, start_timeout_s=300, **kwargs) as stack:
        results = CASES[args.case](stack, args)
    print(json.dumps({"case": args.case, **results}))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
