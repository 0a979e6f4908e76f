"""The probe over real HTTP against the STAND-IN dialect server (tests/support/standin_server.py).

The stand-in replays each server's documented response shapes; it is not vLLM, SGLang or
llama.cpp. Tests run the real CLI as a subprocess: real exit codes, real stdout/stderr split.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from ddtree_diag.backends.dialects import DIALECTS
from ddtree_diag.records import RunReport
from tests.support.processes import ROOT, free_port, sigint_default

# every registered dialect: a new one is fuzzed and probed end to end without touching this file


def probe_json(cli, url, *args):
    result = cli("probe", "--url", url, "--json", "-", *args)
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_each_dialect_auto_detected_and_parsed(standin, cli, dialect, stream):
    server = standin("--dialect", dialect)
    result, report = probe_json(cli, server.url, "--budget", "16", stream)
    assert result.code == 0, result.stderr
    assert report["target"]["dialect"] == dialect
    results = report["results"]
    assert [r["case"]["enable_thinking"] for r in results] == [False, True]
    for record in results:
        assert record["status"] == "ok"
        assert record["output"] == "Hello! It is nice to meet you."
        assert record["completion_tokens"] == 7 and record["finish_reason"] == "stop"
        spec = record["spec"]
        if dialect == "openai":
            assert spec["decode_rounds"] is None and spec["mean_acceptance_length"] is None
        else:
            assert spec["decode_rounds"] == 3
            assert spec["mean_acceptance_length"] == pytest.approx(7 / 3)
        if stream == "--stream" and dialect != "ddtree-mlx":
            assert record["timings"]["ttft_s"] is not None
        else:
            assert record["timings"]["ttft_s"] is None
    sent = [r for r in server.requests() if r.get("max_tokens") == 48]
    assert sent, "the cases were sent with max_tokens 48"
    if dialect == "ddtree":
        assert sent[0]["enable_thinking"] is False and sent[0]["tree_budget"] == 16
    if dialect == "ddtree-mlx":
        assert sent[0]["chat_template_args"] == {"enable_thinking": False}
    if dialect in ("vllm", "sglang", "llamacpp"):
        assert sent[0]["chat_template_kwargs"] == {"enable_thinking": False}
        assert "tree_budget" not in sent[0]


def test_explicit_dialect_skips_detection(standin, cli):
    server = standin("--dialect", "sglang")
    result, report = probe_json(cli, server.url, "--dialect", "sglang", "--model", "standin-model",
                                "--thinking", "off", "--budget", "default")
    assert result.code == 0
    assert [r["max_tokens"] for r in server.requests()] == [48], "no detection request"
    assert report["results"][0]["spec"]["source"] == "response.sglext.spec_tokens_details"


def test_vllm_without_per_request_metrics_falls_back_to_prometheus_delta(standin, cli):
    server = standin("--dialect", "vllm", "--no-per-request-metrics")
    result, report = probe_json(cli, server.url)
    assert result.code == 0, result.stderr
    for record in report["results"]:
        spec = record["spec"]
        assert spec["server_wide"] is True and "prometheus" in spec["source"]
        assert spec["decode_rounds"] == 3 and spec["accepted_tokens"] == 4
        assert spec["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)


def test_vllm_without_any_metrics_shows_unknown_not_zero(standin, cli):
    server = standin("--dialect", "vllm", "--no-per-request-metrics", "--no-metrics-endpoint")
    result, report = probe_json(cli, server.url, "--thinking", "off")
    assert result.code == 0
    assert report["results"][0]["spec"]["decode_rounds"] is None
    table = cli("probe", "--url", server.url, "--thinking", "off").stdout
    assert "—" in table


def test_strict_server_gets_a_retry_without_extra_fields(standin, cli):
    server = standin("--dialect", "openai", "--strict")
    result, report = probe_json(cli, server.url, "--dialect", "openai", "--model", "standin-model", "--no-stream")
    assert result.code == 0, result.stderr
    assert all(r["status"] == "ok" for r in report["results"])
    assert "chat_template_kwargs" in report["results"][0]["extras"]["retried_without_extra_fields"]


def test_connection_refused_is_exit_3_with_one_line(cli):
    url = f"http://127.0.0.1:{free_port()}"
    result = cli("probe", "--url", url, "--model", "m", "--dialect", "openai", "--json", "-")
    assert result.code == 3
    report = json.loads(result.stdout)
    assert all(r["status"] == "transport_error" for r in report["results"])
    assert "connection refused" in report["results"][0]["error"]
    assert "Traceback" not in result.stderr


def test_unreachable_without_model_is_exit_3(cli):
    result = cli("probe", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.code == 3
    assert result.stderr.strip().count("\n") == 0 and "connection refused" in result.stderr


def test_dns_failure_is_exit_3(cli):
    result = cli("probe", "--url", "http://no-such-host.invalid:8000", "--model", "m",
                 "--dialect", "openai", "--thinking", "off", "--json", "-")
    assert result.code == 3
    assert "cannot resolve host" in json.loads(result.stdout)["results"][0]["error"]


def test_timeout_is_marked_and_exit_3(standin, cli):
    server = standin("--dialect", "vllm")
    result, report = probe_json(cli, server.url, "--dialect", "vllm", "--model", "standin-model", "--timeout", "1",
                                "--prompt", "FAIL:slow please", "--thinking", "off")
    assert result.code == 3
    assert report["results"][0]["status"] == "timeout"
    assert "timeout" in report["results"][0]["error"]


@pytest.mark.parametrize(
    "prompt, status, needle",
    [("FAIL:500", "http_error", "HTTP 500: CUDA error"),
     ("FAIL:nonjson", "http_error", "non-JSON body"),
     ("FAIL:nochoices", "http_error", "no choices")],
)
def test_server_errors_mark_the_case_and_others_still_run(standin, cli, prompt, status, needle):
    server = standin("--dialect", "vllm")
    result, report = probe_json(cli, server.url, "--dialect", "vllm", "--no-stream", "--thinking", "off",
                                "--prompt", prompt, "--prompt", "Say hi.")
    assert result.code == 1
    bad, good = report["results"]
    assert bad["status"] == status and needle in bad["error"]
    assert good["status"] == "ok"


def test_truncated_stream_keeps_partial_text(standin, cli):
    server = standin("--dialect", "vllm")
    result, report = probe_json(cli, server.url, "--dialect", "vllm", "--thinking", "off",
                                "--prompt", "FAIL:truncate")
    assert result.code == 3
    record = report["results"][0]
    assert record["status"] == "transport_error" and "before [DONE]" in record["error"]
    assert record["output"].startswith("Hello! It is")


@pytest.mark.parametrize(
    "dialect, prompt, needle",
    [("llamacpp", "FAIL:llamaerror", "server error in stream: Input prompt is too big compared to KV size"),
     ("sglang", "FAIL:abort", "finish_reason 'abort'")],
)
def test_a_stream_the_server_cut_short_fails_the_case(standin, cli, dialect, prompt, needle):
    """llama.cpp's mid-stream ``error:`` line (then [DONE]) and an aborted request's finish reason
    end with HTTP 200 and part of an answer: the case fails with the server's reason, the text kept."""
    server = standin("--dialect", dialect)
    result, report = probe_json(cli, server.url, "--dialect", dialect, "--thinking", "off",
                                "--prompt", prompt, "--prompt", "Say hi.")
    assert result.code == 1, result.stderr
    bad, good = report["results"]
    assert bad["status"] == "http_error" and needle in bad["error"]
    assert bad["output"].startswith("Hello! It is")
    assert good["status"] == "ok"


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_with_two_choices_only_the_first_is_read(standin, cli, stream):
    server = standin("--dialect", "vllm")
    result, report = probe_json(cli, server.url, "--dialect", "vllm", "--thinking", "off", stream,
                                "--prompt", "FAIL:n2 Say hi.")
    assert result.code == 0, result.stderr
    record = report["results"][0]
    assert record["output"] == "Hello! It is nice to meet you." and record["finish_reason"] == "stop"
    assert any("more than one choice" in note for note in record["extras"]["notes"])


def test_json_round_trip_through_records(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree")
    path = tmp_path / "run.json"
    result = cli("probe", "--url", server.url, "--json", str(path))
    assert result.code == 0
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    again = RunReport.from_dict(data).to_dict()
    assert again == data
    assert "Hello! It is nice" in result.stdout  # the table still goes to stdout


def test_json_stdout_is_only_json_and_table_goes_to_stderr(standin, cli):
    server = standin("--dialect", "ddtree")
    result = cli("probe", "--url", server.url, "--json", "-")
    json.loads(result.stdout)  # nothing but JSON
    assert "accept" in result.stderr


def test_non_tty_output_is_plain_and_stable(standin, cli):
    server = standin("--dialect", "ddtree")
    first = cli("probe", "--url", server.url, "--no-stream").stdout
    assert "\x1b[" not in first, "no ANSI escapes when stdout is not a TTY"
    assert "+---" in first or "|" in first
    assert "mean acceptance" in first and "4 cases" in first


def test_api_key_is_sent_but_never_printed_or_saved(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree")
    path = tmp_path / "r.json"
    secret = "sk-test-SECRET-123"
    result = cli("probe", "--url", server.url, "--json", str(path), env={"DDTREE_DIAG_API_KEY": secret})
    assert result.code == 0
    assert secret not in result.stdout + result.stderr + path.read_text()


@pytest.mark.parametrize("secret", ["sk-test-SECRET-123\n", "e"])
def test_a_key_read_with_its_newline_or_a_one_letter_key_runs_clean(standin, cli, tmp_path, secret):
    """A key with echo's newline is sent without it; a one-letter key masks no letter of the report."""
    server = standin("--dialect", "ddtree")
    path = tmp_path / "r.json"
    result = cli("probe", "--url", server.url, "--json", str(path), env={"DDTREE_DIAG_API_KEY": secret})
    assert result.code == 0, result.stderr
    saved = path.read_text()
    if len(secret.strip()) > 1:
        assert secret.strip() not in result.stdout + result.stderr + saved
    assert '"schema_version"' in saved and cli("report", str(path)).code == 0
    assert "Hello" in saved  # the answer's text is not mangled


@pytest.mark.parametrize(
    "args, needle",
    [(["--url", "ftp://x"], "bad --url"),
     (["--url", "http://127.0.0.1:1", "--matrix", "nope.toml"], "not found"),
     (["--url", "http://127.0.0.1:1", "--budget", "-3"], "--budget"),
     (["--url", "http://127.0.0.1:1", "--thinking", "maybe"], "--thinking"),
     (["--url", "http://127.0.0.1:1", "--dialect", "tgi"], "unknown --dialect"),
     (["--thinking", "off"], "no target"),
     # argv bytes that are not UTF-8 (here 0xFF) reach Python as lone surrogates
     (["--url", "http://127.0.0.1:1", "--model", "m\udcff"], "--model is not valid UTF-8"),
     (["--url", "http://127.0.0.1:1", "--api-key", "k\udcff"], "--api-key is not valid UTF-8"),
     (["--url", "http://127.0.0.1:1", "--prompt", "p\udcff"], "--prompt is not valid UTF-8"),
     (["--url", "http://127.0.0.1:1", "--api-key", "clé-KEY"], "--api-key holds a non-ASCII character"),
     (["--url", "http://127.0.0.1:1", "--temperature", "nan"], "finite number"),
     (["--url", "http://127.0.0.1:0"], "port is not a number in 1-65535"),
     (["--url", "http://127.0.0.1:1", "--json", ""], "--json needs a file path"),
     (["--url", "http://127.0.0.1:1", "--junit", "-"], "only --json writes to stdout"),
     (["--url", "http://127.0.0.1:1", "--junit", "same.out", "--html", "same.out"], "both write same.out"),
     (["--engine", "--budget", "100000"], "over the engine's limit 4096")],
)
def test_usage_errors_are_exit_2_one_line(cli, args, needle):
    result = cli("probe", *args)
    assert result.code == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_url_baseline_stops_the_run_before_any_case(standin, cli):
    server = standin("--dialect", "vllm")
    result = cli("probe", "--url", server.url, "--thinking", "off", "--baseline", "url:http://127.0.0.1:9")
    assert result.code == 3, result.stderr
    assert "--baseline" in result.stderr and "connection refused by 127.0.0.1:9" in result.stderr
    # (the main server's 1-token detection request is all it got)
    assert not [r for r in server.requests() if "messages" in r and r.get("max_tokens") != 1], "no case was sent"


def test_bad_toml_names_the_line_and_unknown_key(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[axes]\ntree_budget = [16,\n")
    result = cli("probe", "--url", "http://127.0.0.1:1", "--matrix", str(bad))
    assert result.code == 2 and "invalid TOML" in result.stderr and "line" in result.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[axes]\ntree_budgets = [16]\n")
    result = cli("probe", "--url", "http://127.0.0.1:1", "--matrix", str(unknown))
    assert result.code == 2 and "axes.'tree_budgets'" in result.stderr


def test_ctrl_c_writes_partial_report_and_exits_130(standin, tmp_path):
    server = standin("--dialect", "vllm")
    path = tmp_path / "partial.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "ddtree_diag", "probe", "--url", server.url, "--dialect", "vllm",
         "--model", "standin-model", "--prompt", "Say hi.", "--prompt", "FAIL:slow", "--thinking", "off",
         "--json", str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )
    deadline = time.time() + 30
    while time.time() < deadline and len([r for r in server.requests() if "FAIL:slow" in str(r)]) == 0:
        time.sleep(0.05)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    report = json.loads(path.read_text())
    assert report["interrupted"] is True
    assert [r["case"]["prompt_id"] for r in report["results"]] == ["prompt1"]


def test_concurrency_keeps_matrix_order_and_warns_about_counters(standin, cli):
    server = standin("--dialect", "vllm", "--no-per-request-metrics")
    result, report = probe_json(cli, server.url, "--concurrency", "4", "--budget", "1,2,3",
                                "--repeat", "2")
    assert result.code == 0
    ids = [r["case"]["case_id"] for r in report["results"]]
    assert len(ids) == 12 and ids == sorted(ids, key=ids.index)
    assert [r["case"]["repeat"] for r in report["results"][:2]] == [0, 1]
    assert any("concurrency > 1" in n for n in report["notes"])
    assert all(r["spec"]["decode_rounds"] is None for r in report["results"])
