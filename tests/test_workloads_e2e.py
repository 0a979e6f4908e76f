"""Workload probes end to end: real CLI, real HTTP, STAND-IN servers with real workload faults.

One small matrix holds every workload (a JSON-schema answer, a JSON-object answer, a required tool
call, a thinking prompt, a long-context prompt filled to 2000 tokens, a prefix-cache pair). Healthy
stand-ins (ddtree with a budget0 baseline, streamed; vLLM with a second stand-in as its url
baseline, not streamed) must be quiet; each workload fault flag of the stand-in
(tests/support/standin_server.py) must fire its finding with the right severity, naming the cases.
A few runs each assert several things: the file runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from ddtree_diag.checks.workloads import WORKLOAD_RULES
from ddtree_diag.records import Finding, ProbeResult, RunReport
from tests.support.processes import CliResult, Server, run_cli, start_standin

pytestmark = pytest.mark.e2e

MATRIX = """
[defaults]
max_tokens = 48
temperature = 0.0

[axes]
enable_thinking = [false]
tree_budget = [16]

[prompts.city]
text = "Give the capital of France and its country as JSON."
[prompts.city.json_schema]
type = "object"
required = ["city", "country"]
additionalProperties = false
[prompts.city.json_schema.properties]
city = { type = "string" }
country = { type = "string" }
population = { type = "integer", minimum = 1 }

[prompts.colours]
text = "List the primary colours of light as a JSON object."
response_format = "json_object"

[prompts.weather]
text = "What is the weather in Paris right now?"
tool_choice = "required"
[[prompts.weather.tools]]
name = "get_weather"
description = "Current weather"
[prompts.weather.tools.parameters]
type = "object"
required = ["city", "unit"]
properties = { city = { type = "string" }, unit = { type = "string", enum = ["celsius", "fahrenheit"] } }
[[prompts.weather.tools]]
name = "get_time"
parameters = { type = "object", properties = { city = { type = "string" } }, required = ["city"] }

[prompts.clock]
text = "What time is it in Tokyo?"
tool_choice = "get_time"  # a named tool, not the first one
tools = [
    { name = "get_date", parameters = { type = "object", properties = { city = { type = "string" } } } },
    { name = "get_time", parameters = { type = "object", properties = { zone = { type = "string" } } } },
]

[prompts.reason]
text = "Pens cost 2 euros for 3. How much do 12 pens cost?"
enable_thinking = [true]

[prompts.recall]
text = "In one sentence: what is the document above about?"
fill_tokens = [0, 2000]

[prompts.cache]
text = "Name one place the document above mentions."
prefix_cache = true
"""


def case(prompt: str, *, think: str = "off", budget: int = 16, workload: str = "") -> str:
    return f"{prompt}{workload}/think={think}/budget={budget}/T=0/max=48/r0"


CITY, COLOURS, WEATHER, CLOCK = case("city"), case("colours"), case("weather"), case("clock")
STRUCTURED = [CITY, COLOURS, WEATHER, CLOCK]
REASON = case("reason", think="on")
LONG = case("recall", workload="/ctx=2000")
FIRST, REPEAT = case("cache", workload="/cache=first"), case("cache", workload="/cache=repeat")
WORKLOAD_IDS = {kind.id for rule in WORKLOAD_RULES for kind in rule.kinds}
WEATHER_ARGUMENTS = {"city": "text", "unit": "celsius"}  # the stand-in's minimal valid instance


def probe(tmp: Path, server: Server, dialect: str, *args: str) -> tuple[CliResult, RunReport]:
    """``probe --matrix MATRIX`` over ``server``; (the CLI's result, the JSON report it wrote)."""
    path = tmp / "workloads.toml"
    path.write_text(MATRIX)
    out = tmp / f"run{len(list(tmp.glob('run*.json')))}.json"
    result = run_cli("probe", "--url", server.url, "--dialect", dialect, "--matrix", str(path),
                     "--json", str(out), *args)
    assert out.exists(), result.stderr
    return result, RunReport.from_dict(json.loads(out.read_text()))


def workload_findings(report: RunReport) -> dict[tuple[str, str], Finding]:
    """The workload findings by (id, severity)."""
    return {(f.id, f.severity): f for f in report.findings if f.id in WORKLOAD_IDS}


def by_case(report: RunReport) -> dict[str, ProbeResult]:
    return {r.case_id: r for r in report.results}


def stop(*servers: Server) -> None:
    for server in servers:
        server.process.terminate()
        server.process.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# Healthy servers: quiet, and every workload field filled


@pytest.fixture(scope="module")
def healthy_ddtree(tmp_path_factory):
    """ddtree (reasoning separated) with the budget0 baseline, streamed: (result, report, the
    JSON as written, the chat requests, the /tokenize requests)."""
    tmp = tmp_path_factory.mktemp("healthy-ddtree")
    server = start_standin("--dialect", "ddtree", "--reasoning")
    try:
        result, report = probe(tmp, server, "ddtree", "--baseline", "budget0", "--stream")
        raw = json.loads(next(tmp.glob("run*.json")).read_text())
        tokenized = httpx.get(f"{server.url}/_tokenize").json()
        return result, report, raw, server.requests(), tokenized
    finally:
        stop(server)


@pytest.fixture(scope="module")
def healthy_vllm(tmp_path_factory):
    """vLLM with a second stand-in (no speculation to fault) as the url baseline, not streamed."""
    tmp = tmp_path_factory.mktemp("healthy-vllm")
    # the plain server speculates on nothing, so its answers carry no speculation numbers
    server, plain = start_standin("--dialect", "vllm"), start_standin("--dialect", "vllm", "--no-per-request-metrics")
    try:
        result, report = probe(tmp, server, "vllm", "--baseline", f"url:{plain.url}", "--no-stream")
        return result, report, server.requests()
    finally:
        stop(server, plain)


@pytest.mark.parametrize("which", ["healthy_ddtree", "healthy_vllm"])
def test_healthy_servers_are_quiet(request, which):
    result, report, *_ = request.getfixturevalue(which)
    assert result.code == 0, result.stderr
    assert report.findings == []
    checks = {r.case_id: r.structured for r in report.results if r.structured is not None}
    assert sorted(checks) == sorted(STRUCTURED)
    assert all(c.passed and c.detail == "valid" for c in checks.values())
    assert {c.kind for c in checks.values()} == {"json_schema", "json_object", "tool_call"}
    assert all(r.baseline.verdict == "identical" for r in report.results)
    for result in report.results:
        if result.case_id in checks:
            base = result.baseline.baseline_structured
            assert base["kind"] == checks[result.case_id].kind and base["passed"] and base["detail"] == "valid"


def test_healthy_answers_carry_the_workload_fields(healthy_ddtree):
    _, report, _, requests, tokenized = healthy_ddtree
    results = by_case(report)
    # JSON answers: the schema's instance, the json_object's object
    assert json.loads(results[CITY].output) == {"city": "text", "country": "text", "population": 1}
    assert isinstance(json.loads(results[COLOURS].output), dict)
    # a required tool call: no content, the call with JSON arguments
    weather = results[WEATHER]
    assert weather.output == "" and weather.finish_reason == "tool_calls"
    assert [c["name"] for c in weather.tool_calls] == ["get_weather"] and weather.tool_calls[0]["id"]
    assert json.loads(weather.tool_calls[0]["arguments"]) == WEATHER_ARGUMENTS
    assert weather.baseline.baseline_tool_calls == weather.tool_calls
    clock = results[CLOCK].tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in clock] == [("get_time", {"zone": "text"})]
    sent = [r for r in requests if "tools" in r]
    assert sent[0]["tool_choice"] == "required" and sent[0]["tools"][0]["function"]["name"] == "get_weather"
    assert sent[1]["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    # reasoning separated, in the baseline too
    reason = results[REASON]
    assert reason.reasoning == "The user wants a greeting." and "<think>" not in reason.output
    assert reason.baseline.baseline_reasoning_leak is False
    # the long-context prompt: filled with the server's own count (its /tokenize), which usage agrees with
    long = results[LONG]
    assert long.case.fill["estimated"] is False and 1960 <= long.case.fill["tokens"] <= 2000
    assert long.prompt_tokens == long.case.fill["tokens"]
    assert tokenized and all("messages" in body for body in tokenized)
    assert results[case("recall")].prompt_tokens < 50
    # the prefix-cache pair: the first cold (its own Session line), the repeat served from the cache
    first, repeat = results[FIRST], results[REPEAT]
    assert first.cached_tokens == 0 and repeat.cached_tokens == repeat.prompt_tokens > 0
    cache_requests = [r for r in requests if "Name one place" in json.dumps(r["messages"])]
    assert len(cache_requests) == 4  # the pair, then its baseline pair at tree_budget 0
    assert cache_requests[0]["messages"] == cache_requests[1]["messages"]
    assert cache_requests[0]["messages"][0]["content"].startswith("Session ")
    assert sorted(p.extras["baseline_of"] for p in report.baseline_probes) == [FIRST, REPEAT]
    assert all(p.cached_tokens == p.prompt_tokens for p in report.baseline_probes)  # warm by then


def test_streamed_tool_calls_parse_like_non_streamed(healthy_ddtree, healthy_vllm):
    _, streamed, _, stream_requests, _ = healthy_ddtree
    _, plain, plain_requests = healthy_vllm
    speculative = [r for r in stream_requests if r.get("tree_budget") == 16]
    assert speculative and all(r["stream"] is True for r in speculative)
    assert all(r["stream"] is False for r in plain_requests)
    calls = by_case(streamed)[WEATHER].tool_calls
    assert calls == by_case(plain)[WEATHER].tool_calls  # the same id, name and arguments
    # the budget0 baseline is not streamed: the same run read the call both ways
    assert by_case(streamed)[WEATHER].baseline.baseline_tool_calls == calls
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGUMENTS


def test_report_round_trips_the_workload_fields(healthy_ddtree):
    _, report, raw, _, _ = healthy_ddtree
    assert report.to_dict() == raw
    for result in report.results + report.baseline_probes:
        assert ProbeResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    records = {r["case"]["prompt_id"] + str(r["case"].get("cache_role")): r for r in raw["results"]}
    weather = records["weatherNone"]
    assert weather["tool_calls"][0]["name"] == "get_weather"
    assert weather["structured"]["kind"] == "tool_call" and weather["structured"]["passed"] is True
    assert weather["baseline"]["baseline_tool_calls"] == weather["tool_calls"]
    assert weather["baseline"]["baseline_structured"]["passed"] is True
    assert records["reasonNone"]["baseline"]["baseline_reasoning_leak"] is False
    assert records["cacherepeat"]["cached_tokens"] > 0
    assert [p["extras"]["baseline_of"] for p in raw["baseline_probes"]] == [FIRST, REPEAT]


# ---------------------------------------------------------------------------------------------
# Faulty servers: each fault fires its finding


def test_faults_against_the_budget0_baseline(standin, tmp_path):
    """ddtree: what breaks only with speculation is an error (a warning for the cache and the
    context), judged against the same server at tree_budget 0."""
    server = standin("--dialect", "ddtree", "--structured-broken", "--reasoning-in-content", "--cache-lost",
                     "--context-collapse")
    result, report = probe(tmp_path, server, "ddtree", "--baseline", "budget0")
    found = workload_findings(report)
    assert sorted(found) == [("acceptance-falls-with-context", "warning"), ("prefix-cache-lost-with-speculation",
                             "warning"), ("reasoning-in-content", "error"), ("structured-output-broken", "error")]
    broken = found["structured-output-broken", "error"]
    assert broken.cases == STRUCTURED and "only with speculation" in broken.title
    assert "4/4 structured answers invalid with speculation, valid without" in broken.evidence
    results = by_case(report)
    assert "arguments are not JSON" in results[WEATHER].structured.detail
    assert all(results[c].baseline.baseline_structured["passed"] for c in STRUCTURED)
    assert found["reasoning-in-content", "error"].cases == [REASON]
    assert "</think> in the content" in found["reasoning-in-content", "error"].evidence
    assert results[REASON].baseline.baseline_reasoning_leak is False
    context = found["acceptance-falls-with-context", "warning"]
    assert context.cases == [LONG] and "1.00 at" in context.evidence
    assert results[LONG].spec.mean_acceptance_length == 1.0
    lost = found["prefix-cache-lost-with-speculation", "warning"]
    assert lost.cases == [REPEAT] and "0/" in lost.evidence and "baseline" in lost.evidence
    assert "acceptance-collapse" not in {f.id for f in report.findings}  # one long case is not a collapse
    assert result.code == 1  # the broken answers also differ from the baseline's (lossless mismatch)


def test_faults_against_a_url_baseline(standin, tmp_path):
    """vLLM fixes speculation at start: the faulty server always speculates, a second stand-in
    without the fault is the baseline. Streamed, so broken tool arguments arrive in pieces."""
    server = standin("--dialect", "vllm", "--structured-broken", "--reasoning-in-content", "--cache-lost")
    plain = standin("--dialect", "vllm", "--no-per-request-metrics")  # no speculation: no numbers of it
    _, report = probe(tmp_path, server, "vllm", "--baseline", f"url:{plain.url}", "--stream")
    found = workload_findings(report)
    assert sorted(found) == [("prefix-cache-lost-with-speculation", "warning"), ("reasoning-in-content", "error"),
                             ("structured-output-broken", "error")]
    assert found["structured-output-broken", "error"].cases == STRUCTURED
    assert found["reasoning-in-content", "error"].cases == [REASON]
    assert found["prefix-cache-lost-with-speculation", "warning"].cases == [REPEAT]
    weather = by_case(report)[WEATHER]
    assert weather.tool_calls[0]["name"] == "get_weather" and weather.tool_calls[0]["arguments"].startswith("{")
    assert "arguments are not JSON" in weather.structured.detail
    assert not [r for r in plain.requests() if "tree_budget" in r]


def test_structured_output_not_enforced_is_info(standin, tmp_path):
    """JSON in a Markdown fence and a tool call left as markup in the content, with and without
    speculation: the server does not enforce the format (a configuration fact, not a bug)."""
    server = standin("--dialect", "ddtree", "--no-enforce")
    result, report = probe(tmp_path, server, "ddtree", "--baseline", "budget0")
    found = workload_findings(report)
    assert list(found) == [("structured-output-broken", "info")]
    assert found["structured-output-broken", "info"].cases == STRUCTURED
    results = by_case(report)
    assert "Markdown code fence" in results[CITY].structured.detail
    assert "tool parser did not extract it" in results[WEATHER].structured.detail
    assert results[WEATHER].tool_calls is None
    assert all(r.baseline.verdict == "identical" for r in report.results)
    assert result.code == 0


def test_without_a_baseline_warnings_and_a_cache_hit_that_changes_the_answer(standin, tmp_path):
    server = standin("--dialect", "ddtree", "--structured-broken", "--reasoning-in-content", "--cache-changes-output")
    _, report = probe(tmp_path, server, "ddtree")
    found = workload_findings(report)
    assert sorted(found) == [("prefix-cache-changes-output", "error"), ("reasoning-in-content", "warning"),
                             ("structured-output-broken", "warning")]
    assert found["structured-output-broken", "warning"].cases == STRUCTURED
    assert "--baseline" in found["structured-output-broken", "warning"].check
    assert found["reasoning-in-content", "warning"].cases == [REASON]
    changed = found["prefix-cache-changes-output", "error"]
    assert changed.cases == [REPEAT] and "output differs at character 5" in changed.evidence
    results = by_case(report)
    assert results[FIRST].output == "Hello! It is nice to meet you."
    assert results[REPEAT].output == "Hello again! It is nice to see you."


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2 with one line naming it, before any chat request

BAD = {
    "schema": ('[prompts.city]\ntext = "x"\njson_schema = { type = "objekt" }\n',
               ["prompts.city.json_schema.type", "is not valid JSON Schema"]),
    "tool-name": ('[prompts.weather]\ntext = "x"\ntools = [{ description = "d", parameters = { type = "object" } }]\n',
                  ["prompts.weather.tools[0] has no name"]),
    "fill-beyond-context": ('[prompts.hello]\ntext = "Hi"\n[prompts.recall]\ntext = "What is it about?"\n'
                            "fill_tokens = [0, 2000]\n",
                            ["prompt recall filled to", "beyond the target's context of 1024 tokens"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_workload_input_is_exit_2_before_any_chat_request(standin, cli, tmp_path, name):
    matrix, needles = BAD[name]
    server = standin("--dialect", "vllm", "--max-model-len", "1024")
    path = tmp_path / "bad.toml"
    path.write_text(matrix)
    result = cli("probe", "--url", server.url, "--dialect", "vllm", "--matrix", str(path))
    assert result.code == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), result.stderr
    assert "Traceback" not in result.stderr
    assert server.requests() == []
