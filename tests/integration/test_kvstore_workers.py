"""Workers on the kvcache store, on a real nats-server with a real kvcache shard process and a tiny model on the
CPU: a prompt computed by one worker is loaded from the store by fresh ones (greedy output identical to a
recompute, cached tokens reported by tier, the load a sample of its path's rate); a worker computing faster than
the store loads recomputes without asking; a store that dies mid-load leaves a correct recompute; a burst of
admissions with hits and misses is looked up together, each request answered right.

The workers reach the shard through a TCP proxy in this process (announced in the shard's name on the heartbeat
subject), so a test can cut the data plane at the first GET and kill the shard there: mid-load, deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from opentelemetry.trace import NoOpTracer

from deepinfer import subjects
from deepinfer.config import CommonSettings, DecodeSettings, PrefillSettings
from deepinfer.dataplane.auth import NONCE_BYTES, PROOF_BYTES
from deepinfer.dataplane.frames import LENGTH_PREFIX_BYTES, FrameLimits, FrameOp, decode_header, header_length
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.kv_costs import STORE
from deepinfer.kv_rates import STORE_SHM, Throughput
from deepinfer.protocol import (
    KvStoreHeartbeat,
    PrefillRequest,
    PrefillResult,
    WireSamplingParams,
)
from deepinfer.sampling.params import SamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.testing.streams import decode_locally
from services.decode.handler import DecodeHandler
from services.prefill.handler import PrefillHandler

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRET = "k" * 32
SHARD = "kvw"
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6, 70]  # 21 tokens
NUM_STORED_TOKENS = 20  # 5 full blocks of 4; the last token is always computed
GREEDY = WireSamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GATEWAY = "gw-kv"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def greedy_tokens(tiny_dir, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt's 8 greedy tokens from a local engine (the references the workers' answers must equal)."""
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False))
    for request_id, prompt in prompts.items():
        core.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[int]:
    return greedy_tokens(tiny_dir, {"r": PROMPT})["r"]


class CuttingProxy:
    """Forwards data-plane connections to the shard; with `cut_on_get` set, the first GET frame kills the shard
    (SIGKILL) and drops every connection instead of being forwarded."""

    def __init__(self, upstream: str, shard: subprocess.Popen) -> None:
        self.upstream, self.shard = upstream, shard
        self.cut_on_get = False
        self.ops: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader, writer) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:  # the shard is dead: so is this connection
            writer.close()
            return
        back = asyncio.create_task(self._pipe(up_reader, writer))
        try:
            up_writer.write(await reader.readexactly(NONCE_BYTES + PROOF_BYTES))  # the client's handshake
            while True:
                prefix = await reader.readexactly(LENGTH_PREFIX_BYTES)
                raw = await reader.readexactly(header_length(prefix, FrameLimits()))
                header = decode_header(raw, FrameLimits())
                self.ops.append(header.op.value)
                if header.op == FrameOp.GET and self.cut_on_get:
                    self.shard.send_signal(signal.SIGKILL)  # the store dies mid-load
                    break
                up_writer.write(prefix + raw + await reader.readexactly(sum(header.sizes)))
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            back.cancel()
            writer.close()
            up_writer.close()

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:  # the shard closed (or died): so does the client's connection
            writer.close()


async def start_store(nats_server, bus, tmp_path: Path,
                      extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, CuttingProxy, str]:
    """A real shard process, announced to the workers through the proxy; (process, proxy, real address)."""
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}", "DEEPINFER_NATS_URL": nats_server.url,
           "DEEPINFER_NATS_TOKEN": nats_server.token, "DEEPINFER_DATA_PLANE_SECRET": SECRET,
           "DEEPINFER_DATA_DIR": str(tmp_path / "data"), "DEEPINFER_KVCACHE_INTERNAL_PORT": "0",
           "DEEPINFER_KVCACHE_DATA_PLANE_PORT": "0", "DEEPINFER_KVCACHE_SHARD": SHARD,
           "DEEPINFER_KVCACHE_HEARTBEAT_INTERVAL_S": "3600", "DEEPINFER_LOG_FORMAT": "text"}
    beats: asyncio.Queue[KvStoreHeartbeat] = asyncio.Queue()

    async def on_beat(beat: KvStoreHeartbeat, msg) -> None:
        beats.put_nowait(beat)

    sub = await bus.subscribe(subjects.kvcache_heartbeat(SHARD), on_beat, message_type=KvStoreHeartbeat)
    log = tmp_path / "kvcache.log"
    shard = subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env, cwd=ROOT, stdout=log.open("ab"),
                             stderr=subprocess.STDOUT)
    try:
        beat = await asyncio.wait_for(beats.get(), 60)
    except TimeoutError:
        shard.kill()
        pytest.fail(f"no heartbeat from the shard:\n{log.read_text()[-3000:]}")
    await sub.unsubscribe()
    proxy = CuttingProxy(beat.data_plane_address, shard)
    return shard, proxy, await proxy.start()


@dataclass
class RunningStore:
    """A shard behind its proxy (`running_store`); the workers a test starts go in `workers`."""

    shard: subprocess.Popen
    proxy: CuttingProxy
    address: str
    workers: list = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_store(nats_server, bus, tmp_path: Path,
                        extra_env: dict[str, str] | None = None) -> AsyncIterator[RunningStore]:
    """`start_store`; at the end, its workers closed, the proxy closed and the shard stopped (unless it died)."""
    store = RunningStore(*await start_store(nats_server, bus, tmp_path, extra_env))
    try:
        yield store
    finally:
        await asyncio.gather(*(w.close() for w in store.workers))
        await store.proxy.close()
        if store.shard.poll() is None:
            store.shard.send_signal(signal.SIGTERM)
            store.shard.wait(30)


async def announce(bus, proxy_address: str, host_id: str = "", shm: bool = False) -> None:
    """The shard's heartbeat, with the proxy as its data plane (the shard itself beats once an hour here)."""
    await bus.publish(subjects.kvcache_heartbeat(SHARD), KvStoreHeartbeat(
        shard=SHARD, data_plane_address=proxy_address, internal_address="", ts=time.time(), host_id=host_id,
        shm=shm))


def settings(cls, nats_server, tiny_dir, tmp_path, worker_id: str, **overrides):
    shared = CommonSettings(nats_url=nats_server.url, nats_token=nats_server.token, model=str(tiny_dir),
                            data_plane_secret=SECRET, model_cache_dir=tmp_path)
    fields = {"block_size": 4, "internal_port": 0, "data_plane_port": 0, "kv_store_shard_lease_s": 600,
              "kv_store_load_timeout_s": 5, "kv_store_min_lookup_tokens": 0, **overrides}
    return cls(common=shared, worker_id=worker_id, **fields)


async def start_worker(handler_cls, settings_cls, nats_server, tiny_dir, tmp_path, bus, worker_id, proxy_address,
                       **overrides):
    handler = handler_cls(ServiceContext(worker_id, settings(settings_cls, nats_server, tiny_dir, tmp_path,
                                                             worker_id, **overrides), bus, new_registry(),
                                         NoOpTracer()))
    await handler.load()
    await handler.start()
    await announce(bus, proxy_address)
    for _ in range(100):
        if handler.runtime.store.client.has_shards():
            return handler
        await asyncio.sleep(0.05)
    raise AssertionError("the worker never saw the shard")


async def generate(bus, model: str, decode_id: str, request_id: str):
    """A decode worker computes PROMPT itself (no KV handle): (tokens, the first chunk)."""
    return await decode_locally(bus, model, decode_id, GATEWAY, request_id, PROMPT, GREEDY)


def metric(handler, name: str, **labels) -> float:
    return handler.ctx.registry.get_sample_value(f"deepinfer_{name}", labels) or 0.0


async def written_behind(handler, num_blocks: int) -> None:
    for _ in range(200):
        if metric(handler, "worker_store_written_blocks_total") >= num_blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"write-behind stuck at {metric(handler, 'worker_store_written_blocks_total')}")


async def test_a_prompt_computed_by_one_worker_is_loaded_from_the_store_by_others(
        nats_server, bus, tiny_dir, tmp_path, reference):
    async with running_store(nats_server, bus, tmp_path) as store:
        proxy, address, workers = store.proxy, store.address, store.workers
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-a", address)
        workers.append(first)
        tokens, chunk = await generate(bus, model, "dec-a", "r1")
        assert tokens == reference
        assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 0}
        # The prompt's 5 full blocks (21 tokens; the last one's KV is computed with the first output token); the
        # blocks of generated tokens are not written behind (kv_store_write_generated is off by default).
        await written_behind(first, 5)

        second = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-b",
                                    address)
        workers.append(second)
        tokens, chunk = await generate(bus, model, "dec-b", "r2")
        assert tokens == reference  # the loaded KV is the computed KV
        assert (chunk.num_cached_tokens, chunk.cached_tokens_by_tier) == (20, {"device": 0, "host": 0, "store": 20})
        assert metric(second, "worker_store_loads_total", outcome="loaded") == 1
        assert metric(second, "worker_store_loaded_blocks_total") == 5
        assert metric(second, "worker_store_loaded_bytes_total") > 0
        assert metric(second, "worker_store_load_seconds_count") == 1
        rates = second.runtime.engine.rates  # load or recompute chose the load; the load measured the store
        assert rates.decisions == {(STORE, "loaded"): 20}
        assert (rates.loads[STORE].num_samples, rates.loads[STORE_SHM].num_samples) == (1, 0)

        prefill = await start_worker(PrefillHandler, PrefillSettings, nats_server, tiny_dir, tmp_path, bus, "pre-c",
                                     address)
        workers.append(prefill)
        result = await bus.request(subjects.prefill(model, "pre-c"), PrefillRequest(
            request_id="r3", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=GREEDY), PrefillResult,
            timeout_s=30)
        assert result.error is None and result.first_token_id == reference[0]
        assert (result.num_cached_tokens, result.cached_tokens_by_tier) == (20, {"device": 0, "host": 0, "store": 20})
        assert "get" in proxy.ops and "put" in proxy.ops


async def test_a_same_host_shard_with_shared_memory_serves_the_load_without_the_socket(
        nats_server, bus, tiny_dir, tmp_path, reference):
    shm_env = {"DEEPINFER_KVCACHE_SHM_RAM": "true", "DEEPINFER_KVCACHE_RAM_BYTES": str(16 << 20),
               "DEEPINFER_KVCACHE_SHM_SLOT_BYTES": str(64 << 10)}
    async with running_store(nats_server, bus, tmp_path, shm_env) as store:
        proxy, address, workers = store.proxy, store.address, store.workers
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-a", address)
        workers.append(first)
        tokens, _ = await generate(bus, model, "dec-a", "r1")
        assert tokens == reference
        await written_behind(first, 5)
        second = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-b",
                                    address)
        workers.append(second)
        client = second.runtime.store.client
        await announce(bus, address, client.shared_memory.host_id, shm=True)  # as the shard's own heartbeat says
        for _ in range(100):
            if client.shards.live()[SHARD].shm:
                break
            await asyncio.sleep(0.05)
        ops_before = len(proxy.ops)
        tokens, chunk = await generate(bus, model, "dec-b", "r2")
        assert tokens == reference  # the KV read from the shard's shared memory is the computed KV
        assert (chunk.num_cached_tokens, chunk.cached_tokens_by_tier) == (20, {"device": 0, "host": 0, "store": 20})
        assert metric(second, "worker_store_shm_blocks_total") == 5
        assert metric(second, "worker_store_shm_fallbacks_total") == 0
        rates = second.runtime.engine.rates
        assert (rates.loads[STORE].num_samples, rates.loads[STORE_SHM].num_samples) == (0, 1)
        assert "lease" in proxy.ops[ops_before:] and "get" not in proxy.ops[ops_before:]


async def test_a_prompt_rest_shorter_than_the_lookup_minimum_is_recomputed_without_asking(
        nats_server, bus, tiny_dir, tmp_path, reference):
    async with running_store(nats_server, bus, tmp_path) as store:
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-m",
                                   store.address)
        store.workers.append(first)
        await generate(bus, model, "dec-m", "r12")
        await written_behind(first, 5)  # the prompt's 5 full blocks: 20 tokens the store holds

        for worker_id, minimum, request_id, store_tokens in (("dec-n", 21, "r13", 0), ("dec-o", 20, "r14", 20)):
            worker = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus,
                                        worker_id, store.address, kv_store_min_lookup_tokens=minimum)
            store.workers.append(worker)
            tokens, chunk = await generate(bus, model, worker_id, request_id)
            assert tokens == reference
            assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": store_tokens}
            asked = store_tokens > 0
            assert metric(worker, "worker_store_lookup_round_trips_total") == int(asked)
            assert metric(worker, "worker_store_lookups_total", result="skipped") == int(not asked)

        # A worker that computes a block faster than the store loads one never asks: it recomputes.
        worker = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-p",
                                    store.address)
        store.workers.append(worker)
        worker.runtime.engine.rates.prefill = Throughput(1e12)
        tokens, chunk = await generate(bus, model, "dec-p", "r15")
        assert tokens == reference
        assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 0}
        assert metric(worker, "worker_store_lookup_round_trips_total") == 0
        assert metric(worker, "worker_store_lookups_total", result="slower") == 1


async def test_a_store_that_dies_mid_load_leaves_a_correct_recompute(nats_server, bus, tiny_dir, tmp_path, reference):
    async with running_store(nats_server, bus, tmp_path) as store:
        proxy, address, workers = store.proxy, store.address, store.workers
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-d", address)
        workers.append(first)
        await generate(bus, model, "dec-d", "r4")
        await written_behind(first, 5)

        proxy.cut_on_get = True
        second = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-e",
                                    address)
        workers.append(second)
        tokens, chunk = await generate(bus, model, "dec-e", "r5")
        assert store.shard.wait(10) == -signal.SIGKILL  # the lookup found the blocks; the load's GET killed the store
        assert tokens == reference
        assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 0}
        assert metric(second, "worker_store_loads_total", outcome="failed") == 1
        assert metric(second, "worker_store_loaded_blocks_total") == 0


async def test_a_full_write_behind_queue_drops_blocks_and_counts_them(nats_server, bus, tiny_dir, tmp_path,
                                                                     reference):
    async with running_store(nats_server, bus, tmp_path) as store:
        address = store.address
        model = CommonSettings(model=str(tiny_dir)).model_token
        worker = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-f",
                                    address, kv_store_write_queue_blocks=2,
                                    prefill_chunk_s=0)  # the prompt in one step, not cut by measured time
        store.workers.append(worker)
        tokens, _ = await generate(bus, model, "dec-f", "r6")
        assert tokens == reference  # the step never waits for the store
        await worker.runtime.store.flush(10)
        dropped = metric(worker, "worker_store_write_dropped_blocks_total", reason="queue_full")
        assert dropped >= 3  # the prompt's 5 blocks were cached in one step: 2 queued, 3 dropped
        assert metric(worker, "worker_store_written_blocks_total") + dropped == 5


async def test_with_the_host_tier_the_answer_is_written_behind_from_its_slots_and_the_next_turn_loads_it(
        nats_server, bus, tiny_dir, tmp_path, reference):
    next_turn = [*PROMPT, *reference, 33, 44, 55]  # the conversation goes on: its previous answer, a new question
    expected = greedy_tokens(tiny_dir, {"t2": next_turn})["t2"]
    async with running_store(nats_server, bus, tmp_path) as store:
        address, workers = store.address, store.workers
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-g",
                                   address, kv_host_cache_bytes=1 << 20, kv_store_write_generated=True)
        workers.append(first)
        assert first.runtime.engine.has_host_tier
        tokens, _ = await generate(bus, model, "dec-g", "r7")
        assert tokens == reference
        # 21 prompt tokens and 8 generated, 28 of them computed: 7 full blocks, the answer's 2 included, each
        # written from its host slot once the host tier held it.
        await written_behind(first, 7)
        await first.runtime.store.flush(10)
        assert metric(first, "worker_store_written_blocks_total") == 7

        second = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-h",
                                    address)
        workers.append(second)
        tokens, chunk = await decode_locally(bus, model, "dec-h", GATEWAY, "r8", next_turn, GREEDY)
        assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 28}
        assert tokens == expected  # the KV read from the host slots is the computed KV


async def test_a_burst_with_store_hits_and_misses_is_looked_up_together_and_each_request_is_right(
        nats_server, bus, tiny_dir, tmp_path, reference):
    others = [[(t * (i + 3) + i) % 280 + 10 for t in PROMPT] for i in range(4)]  # no block in common with PROMPT
    expected = greedy_tokens(tiny_dir, {f"o{i}": prompt for i, prompt in enumerate(others)})
    async with running_store(nats_server, bus, tmp_path) as store:
        address, workers = store.address, store.workers
        model = CommonSettings(model=str(tiny_dir)).model_token
        first = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-i", address)
        workers.append(first)
        await generate(bus, model, "dec-i", "r9")
        await written_behind(first, 5)

        second = await start_worker(DecodeHandler, DecodeSettings, nats_server, tiny_dir, tmp_path, bus, "dec-j",
                                    address)
        workers.append(second)
        burst = {**{f"hit{i}": PROMPT for i in range(4)}, **{f"o{i}": prompt for i, prompt in enumerate(others)}}
        results = await asyncio.gather(*(decode_locally(bus, model, "dec-j", GATEWAY, request_id, prompt, GREEDY)
                                         for request_id, prompt in burst.items()))
        for request_id, (tokens, chunk) in zip(burst, results, strict=True):
            if request_id.startswith("hit"):
                assert tokens == reference
                tiers = chunk.cached_tokens_by_tier  # loaded, or (another hit loaded them first) on the device
                assert chunk.num_cached_tokens == tiers["store"] + tiers["device"] == 20
            else:
                assert tokens == expected[request_id]
                assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 0}
        assert metric(second, "worker_store_lookups_total", result="hit") == 4
        assert metric(second, "worker_store_lookups_total", result="miss") == 4
        assert metric(second, "worker_store_loaded_blocks_total") >= 5  # at least one hit loaded its 5 blocks
        # One has for the requests that arrived together (those arriving during it: one more), not one each.
        assert 1 <= metric(second, "worker_store_lookup_round_trips_total") < len(burst)
