"""Wire format: every message round-trips through msgpack; old readers tolerate new fields; bad input is refused."""

from __future__ import annotations

import ast
import hashlib
import inspect
import pathlib

import msgpack
import pytest

import deepinfer.protocol as p

H = [hashlib.sha256(bytes([i])).digest()[:16] for i in range(4)]
LAYOUT = p.KvLayout(dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
SAMPLING = p.WireSamplingParams(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    logit_bias={7: -100.0, 50256: 2.5},
    seed=1234,
    max_tokens=None,
    min_tokens=3,
    stop=["\n\n", "User:"],
    stop_token_ids=[2, 3],
    ignore_eos=True,
    logprobs=5,
    prompt_logprobs=2,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
)
LOGPROBS = p.TokenLogprobs(token_id=42, logprob=-0.125, top=[(42, -0.125), (7, -2.5)])
PROMPT_LOGPROBS = p.PromptLogprobs(logprobs=[-3.5, -0.25], ranks=[12, 1], top_token_ids=[[7, 9], [42, 7]],
                                   top_logprobs=[[-0.5, -1.0], [-0.25, -2.0]])
HANDLE = p.KvHandle(
    request_id="req-1",
    block_hashes=H[:2],
    block_ids=[5, 9],
    num_tokens=32,
    owner_worker_id="prefill-a-1",
    data_plane_address="10.0.0.3:8103",
    layout=LAYOUT,
    layout_id=LAYOUT.layout_id(),
    lease_expires_at_unix_s=1_700_000_030.5,
)
CHUNK = p.TokenChunk(
    request_id="req-1",
    token_ids=[42, 43],
    logprobs=[LOGPROBS, LOGPROBS],
    finish_reason=p.FinishReason.LENGTH,
    num_cached_tokens=32,
    error=None,
    prompt_logprobs=PROMPT_LOGPROBS,
)

MESSAGES: list[p.Message] = [
    SAMPLING,
    p.RouteRequest(
        request_id="req-1", gateway_id="gw-1", block_hashes=H, num_prompt_tokens=70, model_fingerprint=b"\x00" * 32
    ),
    p.RouteDecision(
        request_id="req-1",
        status=p.RouteStatus.OVERLOADED,
        prefill_worker_id=None,
        decode_worker_id="decode-b-2",
        expected_cached_tokens=48,
        retry_after_s=1.5,
        scheduler_id="sched-1",
    ),
    p.PrefillRequest(
        request_id="req-1",
        gateway_id="gw-1",
        prompt_token_ids=list(range(70)),
        sampling=SAMPLING,
        cache_salt="tenant-a",
        block_hashes=H,
    ),
    p.PrefillResult(
        request_id="req-1",
        first_token_id=42,
        first_logprobs=LOGPROBS,
        kv_handle=HANDLE,
        num_cached_tokens=32,
        cached_tokens_by_tier={"device": 16, "store": 16},
        finish_reason=p.FinishReason.STOP,
        error=p.ErrorDetail(code=p.ErrorCode.CONTEXT_LENGTH, message="prompt too long"),
        prompt_logprobs=PROMPT_LOGPROBS,
    ),
    LAYOUT,
    p.KvLayout(dtype="float8_e4m3", block_size=64, num_layers=61, num_kv_heads=0, head_dim=0, latent_dim=576),
    HANDLE,
    p.DecodeRequest(
        request_id="req-1",
        gateway_id="gw-1",
        prompt_token_ids=list(range(70)),
        output_token_ids=[42],
        sampling=SAMPLING,
        cache_salt="tenant-a",
        kv_handle=HANDLE,
        prefill_worker_id="prefill-a-1",
    ),
    p.DecodeAccepted(
        request_id="req-1", status=p.DecodeStatus.REFUSED,
        error=p.ErrorDetail(code=p.ErrorCode.OVERLOADED, message="draining"),
    ),
    LOGPROBS,
    CHUNK,
    p.TokenBatch(worker_id="decode-b-2", step=17, chunks=[CHUNK, p.TokenChunk(request_id="req-2", token_ids=[1])]),
    p.Release(request_id="req-1"),
    p.Cancel(request_id="req-1", reason="client went away"),
    p.KvEvent(event_kind=p.KvEventKind.REMOVED, block_hashes=H[2:], parent_hash=H[1], tier=p.KvTier.HOST),
    p.KvEventBatch(
        worker_id="prefill-a-1",
        seq=99,
        events=[
            p.KvEvent(event_kind=p.KvEventKind.STORED, block_hashes=H, parent_hash=None, tier=p.KvTier.DEVICE),
            p.KvEvent(event_kind=p.KvEventKind.ALL_CLEARED, tier=p.KvTier.DISK),
        ],
        ts=1_700_000_000.25,
    ),
    p.WorkerLoad(
        worker_id="decode-b-2",
        role=p.WorkerRole.DECODE,
        model="smollm2-135m-instruct",
        model_fingerprint=b"\x01" * 32,
        layout_id=LAYOUT.layout_id(),
        block_size=16,
        max_num_seqs=256,
        max_model_len=8192,
        num_running=3,
        num_waiting=1,
        num_free_blocks=1000,
        num_total_blocks=4096,
        data_plane_address="10.0.0.4:8104",
        internal_address="10.0.0.4:8004",
        draining=True,
        ts=1_700_000_000.5,
    ),
    p.SnapshotRequest(cursor=8192, page_size=1024),
    p.SnapshotPage(worker_id="prefill-a-1", seq=99, block_hashes=H, next_cursor=None),
    p.KvLookupRequest(layout_id=LAYOUT.layout_id(), block_hashes=H),
    p.KvLookupReply(present=[True, False, True, True]),
    p.KvStoreEventBatch(
        shard="0",
        seq=5,
        layout_id=LAYOUT.layout_id(),
        stored_block_hashes=H[:1],
        expired_block_hashes=H[1:2],
        evicted_block_hashes=H[2:],
        ts=1_700_000_001.0,
    ),
    p.ErrorDetail(code=p.ErrorCode.BAD_REQUEST, message="temperature must be >= 0"),
    p.KvStoreHeartbeat(
        shard="0", data_plane_address="10.0.0.9:8105", internal_address="10.0.0.9:8005", num_blocks=3,
        ram_bytes=6 << 20, ram_capacity_bytes=4 << 30, disk_bytes=6 << 20, disk_capacity_bytes=64 << 30,
        ts=1_700_000_002.0,
    ),
    PROMPT_LOGPROBS,
]


def test_every_message_class_is_covered():
    exported = {obj for obj in vars(p).values() if inspect.isclass(obj) and issubclass(obj, p.Message)}
    assert exported - {p.Message} == {type(m) for m in MESSAGES}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: p.Message):
    data = message.to_bytes()
    decoded = type(message).from_bytes(data)
    assert decoded == message
    assert decoded.to_bytes() == data


def test_logit_bias_keys_stay_ints():
    decoded = p.WireSamplingParams.from_bytes(SAMPLING.to_bytes())
    assert decoded.logit_bias == {7: -100.0, 50256: 2.5}
    assert all(type(k) is int for k in decoded.logit_bias)


def test_hashes_travel_as_raw_bytes():
    raw = msgpack.unpackb(p.RouteRequest(request_id="r", gateway_id="g", num_prompt_tokens=0, block_hashes=H).to_bytes())
    assert raw["block_hashes"] == H


def test_enums_decode_as_enums():
    decoded = p.KvEventBatch.from_bytes(MESSAGES[16].to_bytes())
    assert decoded.events[0].event_kind is p.KvEventKind.STORED
    assert decoded.events[1].tier is p.KvTier.DISK


def test_old_reader_ignores_new_fields():
    raw = msgpack.unpackb(p.Cancel(request_id="req-9", reason="x").to_bytes())
    raw["added_in_1_1"] = {"nested": [1, 2]}
    raw["v"] = "1.7"
    decoded = p.Cancel.from_bytes(msgpack.packb(raw, use_bin_type=True))
    assert decoded.request_id == "req-9"
    assert not hasattr(decoded, "added_in_1_1")


def test_newer_major_version_is_refused():
    raw = msgpack.unpackb(p.Release(request_id="req-1").to_bytes())
    raw["v"] = f"{p.PROTOCOL_MAJOR + 1}.0"
    with pytest.raises(p.ProtocolError, match=rf"{p.PROTOCOL_MAJOR + 1}\.0"):
        p.Release.from_bytes(msgpack.packb(raw))


def test_wrong_type_names_the_field():
    raw = msgpack.unpackb(CHUNK.to_bytes())
    raw["token_ids"] = "abc"
    with pytest.raises(p.ProtocolError, match="token_ids"):
        p.TokenChunk.from_bytes(msgpack.packb(raw))


def test_short_hash_is_refused():
    raw = msgpack.unpackb(p.KvLookupRequest(layout_id="ab", block_hashes=H).to_bytes())
    raw["block_hashes"][1] = b"\x00" * 15
    with pytest.raises(p.ProtocolError, match="block_hashes"):
        p.KvLookupRequest.from_bytes(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"not msgpack at all \xff\xfe"])
def test_garbage_is_a_protocol_error(data: bytes):
    with pytest.raises(p.ProtocolError):
        p.TokenBatch.from_bytes(data)


def test_handle_with_mismatched_layout_id_is_refused():
    raw = msgpack.unpackb(HANDLE.to_bytes())
    raw["layout"]["dtype"] = "float16"
    with pytest.raises(p.ProtocolError, match="layout_id"):
        p.KvHandle.from_bytes(msgpack.packb(raw, use_bin_type=True))


def test_layout_id_is_stable():
    # Pinned: caches and the store key blocks by layout_id, so it must never change across releases.
    expected = hashlib.sha256(
        b"dtype=bfloat16;block_size=16;num_layers=30;num_kv_heads=3;head_dim=64;kv_layout=nhd;latent_dim=none"
    ).hexdigest()[:16]
    assert LAYOUT.layout_id() == expected
    from deepinfer.hashing import layout_id

    assert layout_id("torch.bfloat16", 16, 30, 3, 64) == expected


def test_layout_id_ignores_schema_version_and_changes_with_dtype():
    assert LAYOUT.model_copy(update={"v": "1.9"}).layout_id() == LAYOUT.layout_id()
    assert LAYOUT.model_copy(update={"dtype": "float16"}).layout_id() != LAYOUT.layout_id()


def test_sampling_defaults():
    s = p.WireSamplingParams()
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_tokens, s.logprobs, s.stop) == (1, 1.0, 1.0, 0, 16, None, [])


def test_nothing_uses_pickle():
    serializers = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    for path in pathlib.Path(p.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & serializers, f"{path.name} imports {names & serializers}"


def test_encoding_is_a_msgpack_map():
    for message in MESSAGES:
        assert isinstance(msgpack.unpackb(message.to_bytes(), strict_map_key=False), dict)


def test_engine_sampling_params_use_the_same_field_names():
    params = pytest.importorskip("deepinfer.sampling.params", reason="engine SamplingParams not written yet")
    import dataclasses

    engine = params.SamplingParams
    names = (
        {f.name for f in dataclasses.fields(engine)}
        if dataclasses.is_dataclass(engine)
        else set(inspect.signature(engine).parameters)
    )
    assert names == set(p.WireSamplingParams.model_fields) - {"v"}
    assert not hasattr(p, "SamplingParams")  # one class per name: the engine's is deepinfer.SamplingParams


def test_prompt_logprobs_lists_are_parallel():
    raw = msgpack.unpackb(PROMPT_LOGPROBS.to_bytes())
    raw["ranks"] = [12]
    with pytest.raises(p.ProtocolError, match="one entry per position"):
        p.PromptLogprobs.from_bytes(msgpack.packb(raw, use_bin_type=True))


def test_handle_ids_cover_every_token_and_hashes_only_full_blocks():
    partial = HANDLE.model_copy(update={"num_tokens": 35, "block_ids": [5, 9, 11]})
    assert p.KvHandle.from_bytes(partial.to_bytes()).block_ids == [5, 9, 11]
    for update in ({"num_tokens": 35}, {"block_hashes": H[:3]}):
        raw = msgpack.unpackb(HANDLE.model_copy(update=update).to_bytes())
        with pytest.raises(p.ProtocolError, match="block_"):
            p.KvHandle.from_bytes(msgpack.packb(raw, use_bin_type=True))


def test_a_refusal_carries_a_typed_error_and_an_acceptance_none():
    error = p.ErrorDetail(code=p.ErrorCode.BAD_REQUEST, message="top_k must be >= -1")
    refused = p.DecodeAccepted.from_bytes(
        p.DecodeAccepted(request_id="r", status=p.DecodeStatus.REFUSED, error=error).to_bytes()
    )
    assert refused.error is not None and refused.error.code is p.ErrorCode.BAD_REQUEST
    for status, err in ((p.DecodeStatus.REFUSED, None), (p.DecodeStatus.ACCEPTED, error)):
        with pytest.raises(ValueError, match="refusal"):
            p.DecodeAccepted(request_id="r", status=status, error=err)


def test_an_unknown_error_code_is_a_protocol_error():
    raw = msgpack.unpackb(p.ErrorDetail(code=p.ErrorCode.TIMEOUT).to_bytes())
    raw["code"] = "gremlins"
    with pytest.raises(p.ProtocolError, match="code"):
        p.ErrorDetail.from_bytes(msgpack.packb(raw))
