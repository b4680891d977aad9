"""Device-to-device KV handoff, the CPU-testable core: block copy by ids, the IPC export's wire form, the handle."""

from __future__ import annotations

import msgpack
import pytest
import torch
from pydantic import create_model

from deepinfer.engine import Engine, EngineArgs, EngineRequest, PeerDeviceKv, PulledKv
from deepinfer.engine.kv_device_transfer import (
    PeerCaches,
    copy_blocks,
    describe_reduced,
    host_id,
    rebuild_args,
)
from deepinfer.protocol.base import Message
from deepinfer.protocol.kv import KvDeviceExport, KvHandle, KvLayout
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 5 blocks of 4


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def caches(num_layers: int, num_blocks: int, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen).to(dtype) for _ in range(num_layers)]


# staging: every layer in one chunk; 1 byte = one layer per chunk; a chunk of 2 layers with a remainder of 1
@pytest.mark.parametrize(("dtype", "staging_bytes"),
                         [(torch.bfloat16, 1 << 20), (torch.float32, 1), (torch.float32, 2 * 12 * 128 * 4)])
def test_copy_by_ids_is_bitwise_and_touches_nothing_else(dtype, staging_bytes):
    src, dst = caches(3, 40, dtype, seed=1), caches(3, 25, dtype, seed=2)
    before = [kv.clone() for kv in dst]
    gen = torch.Generator().manual_seed(3)
    src_ids = (torch.randperm(39, generator=gen)[:12] + 1).tolist()
    dst_ids = (torch.randperm(24, generator=gen)[:12] + 1).tolist()
    copy_blocks(src, src_ids, dst, dst_ids, staging_bytes=staging_bytes)
    for layer in range(3):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dst[layer][:, d].view(torch.uint8), src[layer][:, s].view(torch.uint8))
        untouched = [b for b in range(25) if b not in dst_ids]
        assert torch.equal(dst[layer][:, untouched], before[layer][:, untouched])


def test_copy_latent_caches_and_repeated_source_ids():
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(10, 4, 16, generator=gen) for _ in range(2)]
    dst = [torch.zeros(6, 4, 16) for _ in range(2)]
    copy_blocks(src, [3, 3, 9], dst, [1, 2, 5])
    for layer in range(2):
        assert torch.equal(dst[layer][[1, 2, 5]], src[layer][[3, 3, 9]])


def test_copy_refuses_bad_ids_and_layouts():
    src, dst = caches(2, 8), caches(2, 8)
    with pytest.raises(ValueError, match="padding block"):
        copy_blocks(src, [0], dst, [1])
    with pytest.raises(ValueError, match="outside"):
        copy_blocks(src, [1], dst, [8])
    with pytest.raises(ValueError, match="duplicate"):
        copy_blocks(src, [1, 2], dst, [3, 3])
    with pytest.raises(ValueError, match="different blocks"):
        copy_blocks(src, [1], caches(2, 8, torch.float32), [1])
    with pytest.raises(ValueError, match="layers"):
        copy_blocks(src, [1], dst[:1], [1])


def reduced_args() -> tuple:
    """rebuild_cuda_tensor's argument tuple as `reduce_tensor` lays it out (torch 2.11-2.13)."""
    return (
        torch.Tensor, torch.Size([2, 129, 16, 8, 128]), (264192, 2048, 128, 16, 1), 0, torch.UntypedStorage,
        torch.bfloat16, 0, bytes(range(64)), 541065216, 1048576, False, b"/torch_1234_5678_0", 3,
        bytes(range(64, 128)), True,
    )


def test_export_description_round_trips_through_msgpack():
    desc = describe_reduced(reduced_args(), "GPU-1234")
    export = KvDeviceExport(host_id=host_id(), export_id="e1", layers=[desc, desc])
    raw = export.to_bytes()
    assert b"rebuild_cuda_tensor" not in raw and b"torch" not in raw.replace(b"/torch_", b"")  # no pickle
    decoded = KvDeviceExport.from_bytes(raw)
    assert decoded == export
    args = rebuild_args(decoded.layers[0], device=1)
    expected = list(reduced_args())
    expected[6] = 1  # opened on the local index of the owner's GPU
    assert list(args) == expected
    # what msgpack sees is plain: no classes, bytes stay bytes
    plain = msgpack.unpackb(raw, raw=False)
    assert isinstance(plain["layers"][0]["storage_handle"], bytes)


def test_unknown_dtype_is_refused():
    desc = describe_reduced(reduced_args()).model_copy(update={"dtype": "Size"})
    with pytest.raises(RuntimeError, match="dtype"):
        rebuild_args(desc, 0)


LAYOUT = KvLayout(dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=8, head_dim=128)


def handle(device_transfer: KvDeviceExport | None) -> KvHandle:
    return KvHandle(
        request_id="r", block_hashes=[b"\x01" * 16], block_ids=[5, 9], num_tokens=20, owner_worker_id="p-1",
        data_plane_address="10.0.0.3:8103", layout=LAYOUT, layout_id=LAYOUT.layout_id(),
        lease_expires_at_unix_s=1.5, device_transfer=device_transfer,
    )


def test_handle_field_round_trips_and_an_old_reader_ignores_it():
    export = KvDeviceExport(host_id="h/1", export_id="e1", layers=[describe_reduced(reduced_args())] * 2)
    with_export = handle(export)
    assert KvHandle.from_bytes(with_export.to_bytes()) == with_export
    assert KvHandle.from_bytes(handle(None).to_bytes()).device_transfer is None
    # a 1.0 reader: KvHandle as it was before the field
    fields = {n: (f.annotation, f) for n, f in KvHandle.model_fields.items() if n not in ("v", "device_transfer")}
    old_handle = create_model("OldKvHandle", __base__=Message, **fields)
    old = old_handle.from_bytes(with_export.to_bytes())
    assert old.block_ids == [5, 9] and not hasattr(old, "device_transfer")


def test_device_path_only_for_the_same_host_on_a_gpu():
    export = KvDeviceExport(host_id="h/1", export_id="e1", layers=[describe_reduced(reduced_args())] * 2)
    peers = PeerCaches("h/1")
    assert peers.usable(handle(export), torch.device("cuda", 1))
    assert not peers.usable(handle(export), torch.device("cpu"))
    assert not PeerCaches("h/2").usable(handle(export), torch.device("cuda", 1))
    assert not peers.usable(handle(None), torch.device("cuda", 1))
    short = export.model_copy(update={"layers": export.layers[:1]})
    assert not peers.usable(handle(short), torch.device("cuda", 1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


def run(core: Engine) -> list[int]:
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_admit_from_owner_caches_equals_the_data_plane_path(tiny_dir):
    # A byte budget, not a memory fraction: three engines share the device (CPU here, a GPU on a GPU host).
    args = EngineArgs(model=str(tiny_dir), block_size=4, progress=False, kv_cache_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefill = Engine(args)
    prefill.add_request(EngineRequest("r", PROMPT, params.clone(max_tokens=1), hold_blocks=True))
    first = run(prefill)
    block_ids = prefill.held_block_ids("r")
    by_bytes, by_copy = Engine(args), Engine(args)
    # a prefix hit: 2 blocks reused
    by_bytes.add_request(EngineRequest("warm", PROMPT[:9], params.clone(max_tokens=1)))
    run(by_bytes)
    admission = by_bytes.add_request(EngineRequest("r", PROMPT, params, output_token_ids=first, kv=PulledKv(prefill.export_held("r", block_ids))))
    assert admission.kv == "pulled"
    by_copy.add_request(EngineRequest("warm", PROMPT[:9], params.clone(max_tokens=1)))
    run(by_copy)
    # The owner's export, mapped as a same-host peer's (CPU caches: the mapping step is the GPU test's).
    by_copy._peers._mapped["owner"] = prefill.core.runner.kv_caches
    export = KvDeviceExport(host_id=host_id(), export_id="owner", layers=[])
    admission = by_copy.add_request(EngineRequest("r", PROMPT, params, output_token_ids=first,
                                                  kv=PeerDeviceKv(export, block_ids)))
    assert admission.kv == "device"
    admission.wait_copied()
    scheduler = by_copy.core.scheduler
    dst_ids = scheduler.kv_manager.get_block_ids(scheduler.requests["r"])
    for src, dst in zip(prefill.core.runner.kv_caches, by_copy.core.runner.kv_caches, strict=True):
        assert torch.equal(dst[:, dst_ids[2:5]], src[:, block_ids[2:5]])
    assert run(by_copy) == run(by_bytes)
