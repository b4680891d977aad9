"""Error codes → what the client sees, through the one table; a worker's typed refusal reaches the client with
the status its code names (a bad value is a 400, never a retryable 503)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.protocol import ErrorCode, ErrorDetail
from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.errors import HTTP_ERRORS, ApiError, from_wire
from tests.gateway_harness import MODEL, make_harness

EXPECTED_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.LAYOUT_MISMATCH: 503,
    ErrorCode.TIMEOUT: 504,
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}


def test_every_code_has_exactly_one_status():
    assert set(HTTP_ERRORS) == set(ErrorCode)
    assert {code: http.status_code for code, http in HTTP_ERRORS.items()} == EXPECTED_STATUS


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_wire_error_becomes_openais_error_object(code: ErrorCode):
    error = from_wire(ErrorDetail(code=code, message="why"), "decode worker d1", retry_after_s=2.5)
    assert error.status_code == EXPECTED_STATUS[code]
    body = error.body()["error"]
    assert body["message"] == "decode worker d1: why" and body["code"] == HTTP_ERRORS[code].code
    # Only capacity and rate errors invite a retry.
    assert ("Retry-After" in error.headers()) == (EXPECTED_STATUS[code] in (429, 503))
    if EXPECTED_STATUS[code] in (429, 503):
        assert error.headers()["Retry-After"] == "3"


def test_a_finer_openai_code_can_refine_the_tables():
    error = ApiError(ErrorCode.NOT_FOUND, "The model 'x' does not exist", "model", code="model_not_found")
    assert (error.status_code, error.body()["error"]["code"]) == (404, "model_not_found")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize(
    ("code", "status"),
    [(ErrorCode.BAD_REQUEST, 400), (ErrorCode.CONTEXT_LENGTH, 400), (ErrorCode.OVERLOADED, 503),
     (ErrorCode.LAYOUT_MISMATCH, 503), (ErrorCode.INTERNAL, 500)],
)
async def test_a_decode_refusal_reaches_the_client_with_its_codes_status(model_dir: Path, code, status):
    h = await make_harness(model_dir, refuse_decode=code)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
        streamed = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    for reply in (response, streamed):  # the refusal comes before the first token: a status, not an event
        assert reply.status_code == status, reply.text
        assert reply.json()["error"]["code"] == HTTP_ERRORS[code].code
        assert ("retry-after" in reply.headers) == (status == 503)
    await h.fake.stop()
