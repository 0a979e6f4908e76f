"""Streams and bodies the servers really send at their edges, replayed byte for byte through
httpx.MockTransport (no socket; these are REPLAYED shapes, not the servers themselves).

Each shape is split into network chunks at every byte position too, so nothing depends on where a
server's writes happen to fall.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ddtree_diag.backends.http import HttpBackend, error_field_as_event
from ddtree_diag.records import ProbeCase

CASE = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "Say hi."}], max_tokens=16)
BASE = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def data(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def delta(content: str, index: int = 0, **more) -> bytes:
    return data({**BASE, "choices": [{"index": index, "delta": {"content": content}, **more}]})


FINISH = data({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
DONE = b"data: [DONE]\n\n"
HELLO = delta("Hello") + delta(" there") + delta(".")


def run(stream: bytes | list[bytes], *, streamed: bool = True, dialect: str = "vllm"):
    """One case against a server that answers ``stream`` (one body, or the chunks in order)."""
    chunks = [stream] if isinstance(stream, bytes) else stream

    def handler(request: httpx.Request) -> httpx.Response:
        kind = "text/event-stream" if streamed else "application/json"
        return httpx.Response(200, headers={"content-type": kind}, content=iter(chunks))

    backend = HttpBackend("http://server.invalid:8000", model="m", dialect=dialect, stream=streamed,
                          timeout=5, transport=httpx.MockTransport(handler))
    return backend.run(CASE)


def every_split(stream: bytes) -> list[list[bytes]]:
    return [[stream]] + [[stream[:cut], stream[cut:]] for cut in range(1, len(stream))]


# -- healthy streams at the edges of the format ----------------------------------------------


@pytest.mark.parametrize("stream", [
    HELLO + FINISH + data({**BASE, "choices": [], "usage": USAGE, "error": None}) + DONE,  # "error": null
    HELLO + FINISH + b"data: [DONE] \n\n",  # [DONE] with a trailing space
    b"event: ping\ndata: 2026-12-07 10:00:00.000000\n\n" + HELLO + FINISH + DONE,  # sse-starlette's ping
    b"event: ping\n\n" + HELLO + b": keep-alive\n\n" + FINISH + DONE,  # a ping without data, a comment
    (HELLO + FINISH + DONE).replace(b"\n", b"\r\n"),
], ids=["error-null", "done-space", "ping-with-data", "ping-without-data", "crlf"])
def test_healthy_stream_variants_read_whole(stream):
    result = run(stream)
    assert result.status == "ok", result.error
    assert result.output == "Hello there." and result.finish_reason == "stop"


# -- errors a server sends inside an HTTP 200 -------------------------------------------------

LLAMACPP_ERROR = b'error: {"code": 500, "message": "Input prompt is too big", "type": "server_error"}\n\n'


@pytest.mark.parametrize("stream, needle", [
    (HELLO + LLAMACPP_ERROR + DONE, "Input prompt is too big"),  # llama.cpp: its own SSE field
    (HELLO + data({"object": "error", "message": "CUDA out of memory", "type": "InternalServerError",
                   "code": 500}), "CUDA out of memory"),  # older vLLM: a flat error object
    (HELLO + data({**BASE, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
                   "error": {"code": 502, "message": "Provider disconnected"}}), "Provider disconnected"),
    (HELLO + b"event: error\ndata: upstream timed out\n\n", "upstream timed out"),
    (HELLO + b'event: error\ndata: {"message": "boom"}\n\n', "boom"),
], ids=["llamacpp-error-field", "flat-error", "error-beside-a-choice", "error-event-text", "error-event-json"])
def test_a_server_error_mid_stream_fails_the_case_with_its_message(stream, needle):
    result = run(stream)
    assert result.status == "http_error"
    assert f"server error in stream: {needle}" in result.error
    assert result.output == "Hello there."  # what arrived before is kept


@pytest.mark.parametrize("reason", ["abort", "error"])
@pytest.mark.parametrize("streamed", [True, False])
def test_an_answer_the_server_aborted_fails(reason, streamed):
    if streamed:
        stream = HELLO + data({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}) + DONE
    else:
        stream = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there."},
                                          "finish_reason": reason}]}).encode()
    result = run(stream, streamed=streamed)
    assert result.status == "http_error" and f"finish_reason {reason!r}" in result.error
    assert result.output == "Hello there."


def test_the_llamacpp_error_field_is_seen_wherever_the_chunks_split():
    for chunks in every_split(delta("Hi") + LLAMACPP_ERROR + DONE):
        result = run(chunks, dialect="llamacpp")
        assert result.status == "http_error" and "Input prompt is too big" in result.error, chunks


def test_error_field_rewrite_leaves_every_other_byte_alone():
    stream = (b"data: {\"error\": 1}\r\n\r\n: error: a comment\n\nevent: error\ndata: x\n\n"
              b"data: errors: none\rerror:y\n")
    for chunks in every_split(stream):
        out = b"".join(error_field_as_event(iter(chunks)))
        assert out == stream.replace(b"\rerror:", b"\revent: error\ndata:"), chunks


# -- n > 1, refusals, reasoning fields ------------------------------------------------------


def test_interleaved_choices_keep_choice_zero():
    stream = (delta("Bon", index=1) + delta("Hello") + delta("jour", index=1) + delta(" there.")
              + data({**BASE, "choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]})
              + FINISH + DONE)
    result = run(stream)
    assert result.output == "Hello there." and result.finish_reason == "stop"
    assert any("more than one choice" in note for note in result.extras["notes"])


def test_a_body_with_choice_one_listed_first_reads_choice_zero():
    body = {"choices": [{"index": 1, "message": {"content": "B"}, "finish_reason": "length"},
                        {"index": 0, "message": {"content": "A"}, "finish_reason": "stop"}]}
    result = run(json.dumps(body).encode(), streamed=False)
    assert result.output == "A" and result.finish_reason == "stop"


@pytest.mark.parametrize("streamed", [True, False])
def test_a_refusal_is_read_as_the_output(streamed):
    text = "I'm sorry, I can't help with that."
    if streamed:
        stream = (data({**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "refusal": text[:8]}}]})
                  + data({**BASE, "choices": [{"index": 0, "delta": {"refusal": text[8:]}}]}) + FINISH + DONE)
    else:
        stream = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                                  "refusal": text}, "finish_reason": "stop"}]}).encode()
    result = run(stream, streamed=streamed)
    assert result.status == "ok" and result.output == text
    assert any("refused" in note for note in result.extras["notes"])


def test_an_empty_reasoning_content_beside_reasoning_keeps_the_reasoning():
    body = {"choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"content": "4", "reasoning_content": "", "reasoning": "2 + 2 is 4."}}]}
    result = run(json.dumps(body).encode(), streamed=False)
    assert result.reasoning == "2 + 2 is 4." and result.output == "4"
