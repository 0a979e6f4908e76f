"""The pieces the hardening rests on, one behaviour each: safe JSON, redaction, the deadline,
sizes, counters with bad numbers, and server numbers read as unknown rather than wrong."""

from __future__ import annotations

import base64
import math
import time

import httpx
import pytest

from ddtree_diag import jsonsafe
from ddtree_diag.backends import deadline
from ddtree_diag.backends.dialects.base import integer, num
from ddtree_diag.backends.http import HttpBackend, parse_size
from ddtree_diag.backends.metrics import parse_spec_counters
from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase
from ddtree_diag.redaction import Redactor, clean_api_key, url_without_password
from tests.support.timing import DEADLINE_SLACK_S

# -- jsonsafe ------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64"),
    (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", "nested deeper than 64"),
    (b'{"a": "caf\xe9"}', "invalid UTF-8 in the body at byte 10 (e9 22 7d)"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"a": 1' + b"0" * 5000 + b"}", "not valid JSON"),
])
def test_loads_turns_every_unusable_body_into_one_value_error(data, needle):
    with pytest.raises(ValueError) as caught:
        jsonsafe.loads(data)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_loads_keeps_what_json_allows_and_finite_cleans_it():
    value = jsonsafe.loads(b'{"a": NaN, "b": [Infinity, 1e999, -Infinity, 2], "c": "\\ud800"}')
    found: list[str] = []
    clean = jsonsafe.finite(value, "", found)
    assert clean == {"a": None, "b": [None, None, None, 2], "c": "\ud800"}
    assert found == ["a", "b[0]", "b[1]", "b[2]"]
    assert jsonsafe.dumps(clean, indent=None) == '{"a": null, "b": [null, null, null, 2], "c": "\\ud800"}'


# -- redaction -----------------------------------------------------------------------------------


def test_redactor_masks_keys_passwords_and_their_encodings():
    redactor = Redactor()
    redactor.add("sk-abc/123")
    redactor.add_url("http://alice:p%40ss@host:8000/v1")
    basic = base64.b64encode(b"alice:p@ss").decode()
    text = f"Bearer sk-abc/123 sk-abc%2F123 p@ss p%40ss Basic {basic}"
    assert redactor.text(text) == "Bearer *** *** *** *** Basic ***"
    assert redactor.data({"k sk-abc/123": ["p@ss", 3]}) == {"k ***": ["***", 3]}


def test_a_short_secret_is_masked_only_where_it_stands_alone():
    redactor = Redactor()
    redactor.add("e")
    assert redactor.text("Bearer e, key=e") == "Bearer ***, key=***"
    assert redactor.text("Hello there, schema_version") == "Hello there, schema_version"
    assert redactor.data({"schema_version": "e"}) == {"schema_version": "***"}


@pytest.mark.parametrize(("raw", "clean"), [("sk-KEY\n", "sk-KEY"), ("  sk-KEY \r\n", "sk-KEY"), ("", None),
                                            ("\n", None), (None, None)])
def test_an_api_key_loses_the_whitespace_around_it(raw, clean):
    assert clean_api_key(raw) == clean


@pytest.mark.parametrize(("raw", "kind"), [("abc\nSECRET", "a space"), ("clé-SECRET", "a non-ASCII character"),
                                           ("ab\x01SECRET", "a control character"), ("sk KEY", "a space")])
def test_an_api_key_no_header_can_carry_is_a_usage_error_that_hides_it(raw, kind):
    with pytest.raises(UsageError) as caught:
        clean_api_key(raw)
    assert kind in str(caught.value) and "SECRET" not in str(caught.value) and "KEY" not in str(caught.value)


def test_an_internal_error_stops_the_report_with_the_code_the_cli_exits_with():
    from ddtree_diag.errors import EXIT_USAGE
    from ddtree_diag.orchestrator import exit_code_for, record_stop
    from ddtree_diag.records import RunReport

    report = RunReport()
    record_stop(report, ValueError("boom"))
    assert report.stopped["exit_code"] == EXIT_USAGE and exit_code_for(report) == EXIT_USAGE


@pytest.mark.parametrize("path", ["", "/v1", "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/"])
def test_an_endpoint_pasted_as_the_url_gives_the_base(path):
    from ddtree_diag.backends.http import normalise_url

    assert normalise_url(f"http://h:8000{path}") == "http://h:8000"
    assert normalise_url(f"http://h:8000/proxy{path}") == "http://h:8000/proxy"


def test_https_to_a_plain_port_says_to_try_http():
    import httpx

    from ddtree_diag.backends.http import describe_transport_error

    exc = httpx.ConnectError("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    assert "does it serve plain http://?" in describe_transport_error(exc, "https://h:8000")[1]
    assert "plain http" not in describe_transport_error(httpx.ConnectError("reset"), "https://h:8000")[1]
    certificate = httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed")
    assert "plain http" not in describe_transport_error(certificate, "https://h:8000")[1]


def test_url_is_shown_without_its_password():
    assert url_without_password("http://alice:secret@h:8000/v1") == "http://alice:***@h:8000/v1"
    assert url_without_password("http://h:8000") == "http://h:8000"
    assert url_without_password("http://:secret@[::1]:8000") == "http://:***@[::1]:8000"


# -- deadline ------------------------------------------------------------------------------------


def test_deadline_clamps_every_operation_to_the_time_left():
    assert deadline.remaining() is None and deadline.clamp(7.0) == 7.0
    with deadline.Deadline(0.2):
        assert 0 < deadline.clamp(7.0) <= 0.2
        assert 0 < deadline.clamp(None) <= 0.2
        time.sleep(0.25)
        assert deadline.expired()
        with pytest.raises(deadline.DeadlineExceeded):
            deadline.clamp(7.0)
    assert deadline.remaining() is None, "the deadline ends with its block"


@pytest.mark.timing
def test_streamed_reply_that_never_ends_is_cut_in_process():
    """A transport stub whose body never ends: the reading loop itself cuts at the deadline."""

    def forever():
        while True:
            time.sleep(0.05)
            yield b": keep-alive\n\n"

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=forever()))
    backend = HttpBackend("http://stub.invalid", model="m", dialect="openai", timeout=0.5, transport=transport)
    backend.prepare([])
    started = time.monotonic()
    result = backend.run(ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}]))
    assert result.status == "timeout" and "within 0.5 s (--timeout)" in result.error
    assert time.monotonic() - started < 0.5 + DEADLINE_SLACK_S  # nominal: 0.5 s; a drip never ends


@pytest.mark.e2e
@pytest.mark.timing
def test_backend_cuts_a_silent_server_at_the_deadline():
    """Over a real socket: headers, then nothing. The blocking read itself returns at the deadline."""
    from tests.support.hostile_server import HostileServer, not_found_for_gets

    def silent(request, conn):
        if conn.sse_head():
            conn.hold()

    with HostileServer(not_found_for_gets(silent)) as server:
        backend = HttpBackend(server.url, model="m", dialect="openai", timeout=1.0)
        backend.prepare([])
        result = backend.run(ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}]))
        backend.close()
    assert result.status == "timeout"
    assert 1.0 - 0.05 <= result.timings.e2e_s <= 1.0 + DEADLINE_SLACK_S  # nominal: 1.0 s


# -- sizes, numbers, counters --------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [("8M", 8 << 20), ("512k", 512 << 10), ("1GiB", 1 << 30), ("4096", 4096),
                                        ("1.5M", 3 << 19)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "10", "-5M", "1e400M"])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse_size(text)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 1e16, 10**400, True, "1e999", "x" * 100, [], {}])
def test_absurd_server_numbers_are_unknown_never_wrong(value):
    assert num(value) is None and integer(value) is None


def test_numbers_servers_really_send_are_read():
    assert num("2.5") == 2.5 and integer(7.0) == 7 and integer("12") == 12 and num(0) == 0.0


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3", "1e300"])
def test_counters_with_bad_values_give_no_delta(value):
    good = parse_spec_counters("vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_accepted_tokens_total 20\n")
    bad = parse_spec_counters(f"vllm:spec_decode_num_drafts_total {value}\n"
                              "vllm:spec_decode_num_accepted_tokens_total 30\n")
    assert bad.usable is False
    assert bad.delta(good) is None and good.delta(bad) is None


def test_counters_going_backwards_give_no_delta():
    before = parse_spec_counters("vllm:spec_decode_num_drafts_total 10\n")
    after = parse_spec_counters("vllm:spec_decode_num_drafts_total 4\n")
    assert after.delta(before) is None
    assert parse_spec_counters('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 3\n').usable
