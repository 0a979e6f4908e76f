"""The CLI against a HOSTILE loopback server (tests/support/hostile_server.py): whole-request deadlines,
the response size cap, redirects, credentials, invalid UTF-8 — over real TCP, through the real CLI
process (and through ``--via``), with real exit codes and reports.

The deadline tests measure when the case was cut (the report's ``e2e_s``) against ``--timeout``.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from tests.support.hostile_server import HostileServer, drip, forever, not_found_for_gets
from tests.support.timing import DEADLINE_SLACK_S, RUN_SLACK_S

pytestmark = pytest.mark.e2e

TIMEOUT = 1.0
SLACK = DEADLINE_SLACK_S  # the case must end within TIMEOUT + SLACK (the drips go on for minutes)
SH_HOP = "sh -c 'exec \"$@\"' sh"  # --via through a local shell: the agent runs on "the far side"
FIXED = ("--model", "m", "--dialect", "openai", "--thinking", "off", "--budget", "16", "--max-tokens", "8")  # one case


def chunk(text: str, finish: str | None = None) -> bytes:
    payload = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


def sse_comments_forever(request, conn):
    if conn.sse_head():
        forever(conn, b": keep-alive\n\n", 0.1)


def tokens_forever(request, conn):
    if conn.sse_head():
        forever(conn, chunk("x"), 0.05)


def body_drip(request, conn):
    body = json.dumps({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}).encode() * 50
    if conn.head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}):
        drip(conn, body, 0.25)


def stream_drip(request, conn):
    if conn.sse_head():
        drip(conn, chunk("hello") * 100, 0.25)


def headers_then_nothing(request, conn):
    if conn.sse_head():
        conn.hold()


def no_answer(request, conn):
    conn.hold()


def headers_dripped(request, conn):
    drip(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n", 0.25)


CUT_TIMES: dict[str, float] = {}


@pytest.mark.timing
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
@pytest.mark.parametrize(
    "behaviour",
    [sse_comments_forever, tokens_forever, body_drip, stream_drip, headers_then_nothing, no_answer, headers_dripped],
    ids=lambda b: b.__name__,
)
def test_timeout_is_a_whole_request_deadline(cli, tmp_path, behaviour, stream):
    report_path = tmp_path / "run.json"
    with HostileServer(not_found_for_gets(behaviour)) as server:
        started = time.monotonic()
        result = cli("probe", "--url", server.url, *FIXED, stream, "--timeout", str(TIMEOUT),
                     "--json", str(report_path), timeout=60)
        wall = time.monotonic() - started
    assert result.code == 3, result.stderr
    assert "Traceback" not in result.stderr
    record = json.loads(report_path.read_text())["results"][0]
    assert record["status"] == "timeout", record["error"]
    assert f"within {TIMEOUT:g} s (--timeout)" in record["error"]
    cut = record["timings"]["e2e_s"]
    CUT_TIMES[f"{behaviour.__name__} {stream}"] = cut
    assert TIMEOUT - 0.05 <= cut <= TIMEOUT + SLACK, f"cut at {cut:.2f} s for --timeout {TIMEOUT}"
    assert wall < TIMEOUT + RUN_SLACK_S, "the whole run (start-up included) must not hang"


@pytest.mark.timing
@pytest.mark.parametrize("behaviour", [sse_comments_forever, headers_then_nothing, stream_drip, no_answer],
                         ids=lambda b: b.__name__)
def test_deadline_holds_through_via(cli, tmp_path, behaviour):
    report_path = tmp_path / "run.json"
    with HostileServer(not_found_for_gets(behaviour)) as server:
        result = cli("probe", "--url", server.url, *FIXED, "--timeout", str(TIMEOUT), "--via", SH_HOP,
                     "--json", str(report_path), timeout=60)
    assert result.code == 3, result.stderr
    record = json.loads(report_path.read_text())["results"][0]
    assert record["status"] == "timeout", record["error"]
    cut = record["timings"]["e2e_s"]
    CUT_TIMES[f"via {behaviour.__name__}"] = cut
    assert TIMEOUT - 0.05 <= cut <= TIMEOUT + SLACK, f"cut at {cut:.2f} s through --via"


def test_deadline_report_lists_partial_text_and_other_cases_still_run(cli, tmp_path):
    def behaviour(request, conn):
        prompt = request.json()["messages"][-1]["content"]
        if "stall" in prompt:
            if conn.sse_head():
                conn.send(chunk("partial "))
                forever(conn, b": ping\n\n", 0.1)
        elif conn.sse_head():
            conn.send(chunk("Hello there, friend.", "stop") + b"data: [DONE]\n\n")

    report_path = tmp_path / "run.json"
    with HostileServer(not_found_for_gets(behaviour)) as server:
        result = cli("probe", "--url", server.url, *FIXED, "-p", "stall please", "-p", "Say hi.",
                     "--timeout", str(TIMEOUT), "--json", str(report_path), timeout=60)
    assert result.code == 3
    first, second = json.loads(report_path.read_text())["results"]
    assert first["status"] == "timeout" and first["output"] == "partial "
    assert "stream events" in first["error"]
    assert second["status"] == "ok" and second["output"] == "Hello there, friend."


def test_response_size_cap(cli, tmp_path):
    def behaviour(request, conn):
        if request.json().get("stream"):
            if conn.sse_head():
                forever(conn, chunk("y" * 4000), 0.0)
        else:
            conn.body(200, b'{"choices": [{"message": {"content": "' + b"z" * (3 << 20) + b'"}}]}')

    with HostileServer(not_found_for_gets(behaviour)) as server:
        for stream in ("--stream", "--no-stream"):
            result = cli("probe", "--url", server.url, *FIXED, stream, "--max-response-bytes", "1M", "--json", "-")
            assert result.code == 1, result.stderr
            record = result.json()["results"][0]
            assert record["status"] == "http_error"
            assert record["error"] == "response larger than 1 MiB (--max-response-bytes)"


def test_bad_max_response_bytes_is_usage_error(cli):
    result = cli("probe", "--url", "http://127.0.0.1:9", *FIXED, "--max-response-bytes", "lots")
    assert result.code == 2 and "--max-response-bytes" in result.stderr


def test_redirect_is_reported_as_a_redirect(cli):
    def behaviour(request, conn):
        conn.body(301, b"moved", "text/plain", headers={"Location": "http://elsewhere.example:8000/v1/chat/completions"})

    with HostileServer(behaviour) as server:
        result = cli("probe", "--url", server.url, *FIXED, "--json", "-")
        assert result.code == 1
        error = result.json()["results"][0]["error"]
        assert error.startswith("HTTP 301: redirect to 'http://elsewhere.example:8000/v1/chat/completions'")
        # without --model, /v1/models answering a redirect is a configuration error
        result = cli("probe", "--url", server.url)
        assert result.code == 2 and "redirect to" in result.stderr and result.stderr.count("\n") == 1


def test_invalid_utf8_is_reported_as_invalid_utf8(cli):
    def behaviour(request, conn):
        if request.json().get("stream"):
            if conn.sse_head():
                conn.send(b'data: {"choices": [{"delta": {"content": "caf\xe9"}}]}\n\n')
        else:
            conn.body(200, b'{"choices": [{"message": {"content": "caf\xe9"}, "finish_reason": "stop"}]}')

    with HostileServer(not_found_for_gets(behaviour)) as server:
        for stream, where in (("--stream", "in the stream"), ("--no-stream", "in the response body")):
            result = cli("probe", "--url", server.url, *FIXED, stream, "--json", "-")
            assert result.code == 1, result.stderr
            error = result.json()["results"][0]["error"]
            assert error.startswith(f"invalid UTF-8 {where}") and "e9" in error


SECRET = "sk-live-SECRET-key-4242"
PASSWORD = "pw-Hunter2-secret"


def echo_credentials(request, conn):
    """An unhelpful server: every answer repeats the credentials it was sent."""
    auth = request.headers.get("authorization", "")
    if request.method == "GET" and request.path == "/v1/models":
        conn.json(200, {"data": [{"id": f"model-for-{auth}", "owned_by": auth}]})
    elif request.method == "GET":
        conn.json(404, {"error": {"message": f"no metrics for {auth}"}})
    else:
        conn.json(500, {"error": {"message": f"upstream rejected header Authorization: {auth}"}})


@pytest.mark.parametrize("credential", ["api-key", "url-password"])
def test_secrets_never_shown_or_saved_even_when_echoed(cli, tmp_path, credential):
    with HostileServer(echo_credentials) as server:
        if credential == "api-key":
            url, extra, echoed = server.url, ("--api-key", SECRET), "Bearer ***"
        else:  # httpx sends URL userinfo as Basic auth
            url, extra, echoed = server.url.replace("http://", f"http://alice:{PASSWORD}@"), (), "Basic ***"
        outputs = {name: tmp_path / name for name in ("run.json", "junit.xml", "summary.md")}
        result = cli("probe", "--url", url, "--thinking", "off", "--json", str(outputs["run.json"]),
                     "--junit", str(outputs["junit.xml"]), "--summary", str(outputs["summary.md"]), *extra)
        assert result.code == 1, result.stderr
        basic = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
        seen = result.stdout + result.stderr + "".join(p.read_text() for p in outputs.values())
        assert f"upstream rejected header Authorization: {echoed}" in seen, "the echo is shown, masked"
        for secret in (SECRET, PASSWORD, basic):
            assert secret not in seen
        report = json.loads(outputs["run.json"].read_text())
        assert report["target"]["url"] == url.replace(PASSWORD, "***")
        assert report["target"]["model"] == f"model-for-{echoed}"
        # the server did receive the credential: redaction is about showing, not sending
        assert any((SECRET if credential == "api-key" else basic) in r.headers.get("authorization", "")
                   for r in server.requests)


def test_secret_in_a_bad_url_is_not_printed(cli):
    result = cli("probe", "--url", f"http://bob:{PASSWORD}@127.0.0.1:99999", "--api-key", SECRET)
    assert result.code == 2 and "bad --url" in result.stderr
    assert PASSWORD not in result.stderr and "***" in result.stderr


def unauthorized(request, conn):
    conn.json(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})


def test_401_hints_at_the_api_key_and_exits_2(cli, tmp_path):
    with HostileServer(unauthorized) as server:
        result = cli("probe", "--url", server.url)  # /v1/models answers 401
        assert result.code == 2 and "--api-key" in result.stderr and result.stderr.count("\n") == 1
        result = cli("probe", "--url", server.url, "--model", "m")  # the detection request answers 401
        assert result.code == 2 and "--api-key" in result.stderr
        result = cli("probe", "--url", server.url, *FIXED, "--json", "-")  # the cases themselves
        assert result.code == 2
        error = result.json()["results"][0]["error"]
        assert error.startswith("HTTP 401: Incorrect API key provided") and "--api-key" in error
        result = cli("probe", "--url", server.url, *FIXED, "--api-key", "wrong", "--json", "-")
        assert "the API key was refused" in result.json()["results"][0]["error"]


def test_dialect_is_never_guessed_from_an_error_reply(cli):
    def behaviour(request, conn):
        if request.method == "GET" and request.path == "/v1/models":
            conn.json(200, {"data": [{"id": "m", "owned_by": "someone"}]})
        elif request.method == "GET":
            conn.json(404, {})
        elif request.json().get("max_tokens") == 1:  # the detection request: an error carrying a ddtree object
            conn.json(503, {"error": {"message": "warming up"}, "ddtree": {"decode_rounds": 1}})
        else:
            conn.json(200, {"choices": [{"message": {"content": "Hello there."}, "finish_reason": "stop"}]})

    with HostileServer(behaviour) as server:
        result = cli("probe", "--url", server.url, "--thinking", "off", "--json", "-")
    assert result.code == 0, result.stderr
    report = result.json()
    assert report["target"]["dialect"] == "openai"
    assert "the detection request failed (HTTP 503: warming up)" in report["target"]["dialect_detection"]


def test_report_cut_times(capsys):
    """Prints the measured cut times of the deadline tests above (run with -s to see them)."""
    if not CUT_TIMES:
        pytest.skip("the deadline tests did not run")
    with capsys.disabled():
        print(f"\n--timeout {TIMEOUT:g}: cut at " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(CUT_TIMES.items())))
    assert max(CUT_TIMES.values()) <= TIMEOUT + SLACK
