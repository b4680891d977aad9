"""Prefill owner on cuda:0, decode receiver on cuda:1, two spawned processes: KV pulled by CUDA IPC.

128 blocks of a Llama-3.1-8B layout (32 layers, 8 KV heads, head_dim 128, block_size 16, bf16: 2 MiB per block)
are copied by block id from the owner's mapped cache into the receiver's cache, bitwise equal, and the pull's
GB/s is printed beside a raw `tensor.to("cuda:1")` of the same number of bytes in the same run.
The export crosses the process boundary as msgpack bytes on a pipe (send_bytes), never as pickle.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 32, 16, 8, 128
OWNER_BLOCKS, RECEIVER_BLOCKS, NUM_PULLED, SEED, REPEATS = 384, 256, 128, 1234, 10


def _fill(device: str) -> list[torch.Tensor]:
    """The owner's cache, drawn from a seeded CUDA generator so any GPU can redraw it bit for bit."""
    caches = []
    for layer in range(NUM_LAYERS):
        gen = torch.Generator(device).manual_seed(SEED + layer)
        shape = (2, OWNER_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches.append(torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16))
    return caches


def _owner(conn) -> None:
    from deepinfer.engine.kv_device_transfer import export_caches, host_id

    caches = _fill("cuda:0")
    torch.cuda.synchronize("cuda:0")
    conn.send_bytes(export_caches(caches, host_id()).to_bytes())
    conn.recv_bytes()  # the receiver is done: our cache may go
    del caches


def _timed(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _phases(src, src_ids, dst, dst_ids) -> dict:
    """Seconds of the pull's three parts alone: gather on cuda:0, one peer copy, scatter on cuda:1."""
    src_index = torch.tensor(src_ids, device="cuda:0")
    dst_index = torch.tensor(dst_ids, device="cuda:1")
    staging = torch.empty((NUM_LAYERS, 2, NUM_PULLED, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                          device="cuda:0")
    moved = torch.empty_like(staging, device="cuda:1")

    def gather():
        for layer in range(NUM_LAYERS):
            torch.index_select(src[layer], 1, src_index, out=staging[layer])

    def scatter():
        for layer in range(NUM_LAYERS):
            dst[layer].index_copy_(1, dst_index, moved[layer])

    return {"gather": _timed(gather), "peer_copy": _timed(lambda: moved.copy_(staging)), "scatter": _timed(scatter)}


def _receiver(conn, result_conn) -> None:
    from deepinfer.engine.kv_device_transfer import PeerCaches, copy_blocks, host_id
    from deepinfer.protocol.kv import KvDeviceExport

    export = KvDeviceExport.from_bytes(conn.recv_bytes())
    peers = PeerCaches(host_id())
    src = peers.get(export)
    gen = torch.Generator().manual_seed(7)
    src_ids = (torch.randperm(OWNER_BLOCKS - 1, generator=gen)[:NUM_PULLED] + 1).tolist()
    dst_ids = (torch.randperm(RECEIVER_BLOCKS - 1, generator=gen)[:NUM_PULLED] + 1).tolist()
    dst = [torch.zeros(2, RECEIVER_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                       device="cuda:1") for _ in range(NUM_LAYERS)]
    pull_s = _timed(lambda: copy_blocks(src, src_ids, dst, dst_ids))
    # The oracle: the owner's cache redrawn here from its seed, on our GPU (never read through the mapping).
    expected = _fill("cuda:1")
    equal = all(
        torch.equal(d[:, dst_ids].view(torch.int16), e[:, src_ids].view(torch.int16))
        for d, e in zip(dst, expected, strict=True)
    )
    nbytes = NUM_PULLED * NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    raw = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    raw_s = _timed(lambda: raw.to("cuda:1"))
    devices = [torch.cuda.get_device_name(i) for i in range(2)]
    phases = _phases(src, src_ids, dst, dst_ids)
    result_conn.send_bytes(json.dumps({
        "equal": equal, "nbytes": nbytes, "ipc_pull_s": pull_s, "raw_copy_s": raw_s, "phases_s": phases,
        "block_nbytes": nbytes // NUM_PULLED, "devices": devices,
    }).encode())
    conn.send_bytes(b"done")


def test_ipc_pull_of_128_blocks_is_bitwise_equal_and_reports_gbps():
    ctx = mp.get_context("spawn")
    owner_end, receiver_end = ctx.Pipe()
    result_recv, result_send = ctx.Pipe(duplex=False)
    owner = ctx.Process(target=_owner, args=(owner_end,))
    receiver = ctx.Process(target=_receiver, args=(receiver_end, result_send))
    owner.start()
    receiver.start()
    try:
        deadline = time.monotonic() + 300
        while not result_recv.poll(1):  # a receiver that died answers never: fail at once, not after 300 s
            assert receiver.is_alive() and owner.is_alive(), (
                f"a process died: receiver exit {receiver.exitcode}, owner exit {owner.exitcode}")
            assert time.monotonic() < deadline, "the receiver sent no result within 300 s"
        result = json.loads(result_recv.recv_bytes())
    finally:
        receiver.join(60)
        owner.join(60)
        for proc in (receiver, owner):
            if proc.is_alive():
                proc.kill()
    assert receiver.exitcode == 0 and owner.exitcode == 0
    assert result["block_nbytes"] == 2 * 1024 * 1024
    assert result["equal"], "pulled blocks differ from the owner's"
    gib = result["nbytes"] / 1e9
    print(
        f"\nKV pull by CUDA IPC, cuda:0 → cuda:1 ({result['devices']}): {NUM_PULLED} blocks × 2 MiB, "
        f"{gib / result['ipc_pull_s']:.1f} GB/s (gather, one peer copy per 256 MiB, scatter) vs "
        f"raw tensor.to('cuda:1') of the same bytes {gib / result['raw_copy_s']:.1f} GB/s; phases alone (ms): "
        + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in result["phases_s"].items())
    )
