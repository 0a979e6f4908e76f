"""Workload checks on records: the structured-output check, the matrix's workload keys, tool calls
and cached tokens read from each documented response shape, and the five workload findings on runs
built from records (margins and the differential against the baseline)."""

from __future__ import annotations

import json

import pytest

from ddtree_diag.backends.dialects import get as dialect
from ddtree_diag.backends.metrics import parse_prefix_cache_hits
from ddtree_diag.checks import findings, lossless, structured, workloads
from ddtree_diag.errors import UsageError
from ddtree_diag.matrix import MatrixRequest, matrix_from_dict, resolve_matrix
from ddtree_diag.records import BaselineComparison, ProbeCase, ProbeResult, RunReport, SpecMetrics, Timings

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
TOOLS = structured.tools([{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}, {"name": "get_time"}], "tools")


def answer(output="", *, fmt=None, tools=None, choice=None, calls=None, thinking=None, reasoning=None, finish="stop",
           **case) -> ProbeResult:
    probe = ProbeCase(prompt_id=case.pop("prompt_id", "p"), messages=[{"role": "user", "content": "q"}],
                      response_format=fmt, tools=tools, tool_choice=choice, enable_thinking=thinking, **case)
    result = ProbeResult(case=probe, output=output, tool_calls=calls, reasoning=reasoning, finish_reason=finish)
    result.structured = structured.check(result)
    return result


def call(name, arguments) -> dict:
    return {"id": "c1", "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}


# ---------------------------------------------------------------------------------------------
# The structured-output check


@pytest.mark.parametrize("output, passed, detail", [
    ('{"city": "Paris", "population": 2100000}', True, "valid"),
    ('  {"city": "Paris", "population": 2100000}\n', True, "valid"),
    ('{"city": "Paris"}', False, "'population' is a required property"),
    ('{"city": "Paris", "population": "many"}', False, "$.population"),
    ('{"city": "Paris", "population": 1, "x": 1}', False, "Additional properties"),
    ('{"city": "Par', False, "not JSON"),
    # a key said twice: json.loads would keep the last and the schema would pass
    ('{"city": "Paris", "city": "Paris", "population": 2100000}', False, "'city' appears twice"),
    ('```json\n{"city": "Paris", "population": 1}\n```', False, "code fence"),
    ("Paris is the capital.", False, "not JSON"),
    ("", False, "empty answer"),
])
def test_a_json_schema_answer_is_checked_against_its_schema(output, passed, detail):
    check = answer(output, fmt=FORMAT).structured
    assert check is not None and check.kind == "json_schema"
    assert check.passed is passed and detail in check.detail


def test_json_mode_needs_an_object_and_a_cut_answer_says_so():
    assert answer('{"a": [1, 2]}', fmt={"type": "json_object"}).structured.passed
    assert "an object expected" in answer("[1, 2]", fmt={"type": "json_object"}).structured.detail
    cut = answer('{"a": [1, ', fmt={"type": "json_object"}, finish="length").structured
    assert not cut.passed and cut.detail.endswith("(cut at max_tokens)")


def test_plain_cases_and_failed_requests_get_no_structured_check():
    assert answer("hi").structured is None
    assert answer("hi", fmt={"type": "text"}).structured is None
    failed = answer("", fmt=FORMAT)
    failed.status = "http_error"
    assert structured.check(failed) is None
    assert answer("hi", tools=TOOLS, choice="none").structured is None


@pytest.mark.parametrize("calls, choice, output, problem", [
    ([call("get_weather", {"city": "Paris"})], "required", "", None),
    ([call("get_weather", {"city": "Paris", "unit": "c"})], {"type": "function", "function": {"name": "get_weather"}},
     "", None),
    (None, "required", "It is sunny.", "no tool call (tool_choice required)"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "", "tool_choice names get_time"),
    ([call("get_time", {})], {"type": "function", "function": {"name": "get_weather"}}, "",
     "calls 'get_time', tool_choice names get_weather"),
    ([call("get_wether", {"city": "Paris"})], "required", "", "not one of the tools"),
    ([call("get_weather", '{"city": "Par')], "required", "", "arguments are not JSON"),
    ([call("get_weather", '{"city": "Paris", "city": "Paris"}')], "required", "", "'city' appears twice"),
    ([call("get_weather", {"unit": "c"})], "required", "", "'city' is a required property"),
    ([call("get_weather", {"city": "Paris", "unit": "kelvin"})], "required", "", "is not one of"),
    ([call("get_weather", "[1]")], "auto", "", "not a JSON object"),
    (None, "auto", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "left in"),
    (None, "auto", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "left in the content"),
    (None, "auto", "It is sunny in Paris.", None),
])
def test_tool_calls_are_checked_against_the_tools(calls, choice, output, problem):
    check = answer(output, tools=TOOLS, choice=choice, calls=calls).structured
    assert check.kind == "tool_call"
    if problem is None:
        assert check.passed, check.detail
    else:
        assert not check.passed and problem in check.detail


# ---------------------------------------------------------------------------------------------
# Matrix keys


def prompts(**spec) -> dict:
    return {"prompts": {"p": {"text": "q", **spec}}}


def test_matrix_prompts_carry_their_workload_into_the_cases():
    matrix = matrix_from_dict({
        "axes": {"enable_thinking": [False], "tree_budget": [16, 64]},
        "prompts": {
            "city": {"text": "q", "json_schema": SCHEMA},
            "tool": {"text": "q", "tools": [{"name": "get_weather"}], "tool_choice": "get_weather"},
            "long": {"text": "q", "fill_tokens": [0, "2k"], "prefix_cache": True},
            "think": {"text": "q", "enable_thinking": True, "max_tokens": 300},
        },
    })
    cases = matrix.cases()
    city = cases[0]
    assert city.response_format == {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                                           "strict": True}}
    tool = next(c for c in cases if c.prompt_id == "tool")
    assert tool.tools[0] == {"type": "function", "function": {"name": "get_weather",
                                                              "parameters": {"type": "object", "properties": {}}}}
    assert tool.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    long = [c.case_id for c in cases if c.prompt_id == "long" and c.tree_budget == 16]
    assert long == ["long/cache=first/think=off/budget=16/T=0/max=48/r0",
                    "long/cache=repeat/think=off/budget=16/T=0/max=48/r0",
                    "long/ctx=2048/cache=first/think=off/budget=16/T=0/max=48/r0",
                    "long/ctx=2048/cache=repeat/think=off/budget=16/T=0/max=48/r0"]
    think = [c for c in cases if c.prompt_id == "think"]
    assert {(c.enable_thinking, c.max_tokens) for c in think} == {(True, 300)}


def test_fill_flag_resizes_the_long_prompts_only(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[prompts.a]\ntext = "q"\n[prompts.b]\ntext = "q"\nfill_tokens = [1000]\n')
    cases = resolve_matrix(MatrixRequest(matrix=str(path), thinking="off", fill="0,8k")).cases()
    assert [(c.prompt_id, c.context_tokens) for c in cases] == [("a", None), ("b", None), ("b", 8192)]
    plain = resolve_matrix(MatrixRequest(prompts=["hi"], thinking="off", fill="4096")).cases()
    assert [c.context_tokens for c in plain] == [4096]


@pytest.mark.parametrize("spec, message", [
    ({"json_schema": {"type": 5}}, "prompts.p.json_schema.type is not valid JSON Schema"),
    ({"json_schema": {"properties": {"a": {"type": "strang"}}}}, "json_schema.properties.a.type is not valid"),
    ({"response_format": "yaml"}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "needs a schema table"),
    ({"json_schema": {}, "response_format": "json_object"}, "not both"),
    ({"tools": [{"description": "no name"}]}, "tools[0] has no name"),
    ({"tools": [{"name": "a"}, {"name": "a"}]}, "used twice"),
    ({"tools": [{"name": "a", "parameters": {"type": "objekt"}}]}, "tools[0].function.parameters.type is not valid"),
    ({"tools": [{"name": "a"}], "tool_choice": "b"}, "must be none, auto, required or a tool name (a)"),
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"fill_tokens": [-1]}, "expected token counts"),
    ({"fill_tokens": ["lots"]}, "expected token counts"),
    ({"prefix_cache": "yes"}, "prefix_cache must be true or false"),
    ({"max_tokens": 0}, "prompts.p.max_tokens"),
])
def test_bad_workload_keys_are_one_line_naming_them(spec, message):
    with pytest.raises(UsageError) as raised:
        matrix_from_dict(prompts(**spec), source="m.toml")
    assert message in str(raised.value) and "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------
# Wire formats: requests carry the workload, answers give tool calls and cached tokens back


@pytest.mark.parametrize("name", ["ddtree", "ddtree-mlx", "vllm", "sglang", "llamacpp", "openai"])
def test_every_dialect_sends_the_workload_even_minimal(name):
    case = ProbeCase("p", [{"role": "user", "content": "q"}], response_format=FORMAT, tools=TOOLS,
                     tool_choice="required")
    for minimal in (False, True):
        body = dialect(name).build_request(case, "m", stream=True, minimal=minimal)
        assert body["response_format"] == FORMAT and body["tools"] == TOOLS and body["tool_choice"] == "required"


def test_tool_calls_and_cached_tokens_are_read_from_a_body():
    body = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}},
    ]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 896}}}
    parsed = dialect("vllm").parse_body(body, ProbeCase("p", []))
    assert parsed.tool_calls == [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                                 {"id": "call_2", "name": "get_time", "arguments": '{"city": "Oslo"}'}]
    assert parsed.cached_tokens == 896 and parsed.output == ""


def test_streamed_tool_call_pieces_are_joined_by_index():
    accumulator = dialect("openai").accumulator()
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "get_time"}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
    ]
    added = [accumulator.feed(c) for c in chunks]
    assert added[0] == "get_weather" and added[1] == '{"ci'  # a call's first piece counts for TTFT
    parsed = accumulator.result(ProbeCase("p", []))
    assert parsed.tool_calls == [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                                 {"id": "call_2", "name": "get_time", "arguments": ""}]


def test_llamacpp_cache_n_is_the_cached_prompt():
    body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "timings": {"cache_n": 512, "prompt_n": 4, "predicted_n": 2}}
    assert dialect("llamacpp").parse_body(body, ProbeCase("p", [])).cached_tokens == 512


def test_prefix_cache_hits_are_read_from_a_metrics_page():
    page = ("# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{engine="0"} 100\nvllm:prefix_cache_hits_total{engine="1"} 28\n'
            'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
    assert parse_prefix_cache_hits(page) == 128
    assert parse_prefix_cache_hits("# TYPE x counter\nx_total 3\n") is None
    assert parse_prefix_cache_hits('vllm:prefix_cache_hits_total{engine="0"} NaN\n') is None
    # SGLang counts each finished request's cached prompt tokens
    sglang = ('# TYPE sglang:cached_tokens_total counter\nsglang:cached_tokens_total{model_name="m"} 4096\n'
              '# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total{model_name="m"} 9000\n')
    assert parse_prefix_cache_hits(sglang) == 4096


# ---------------------------------------------------------------------------------------------
# Findings on runs built from records


def compared(result: ProbeResult, baseline: ProbeResult) -> ProbeResult:
    spec = lossless.BaselineSpec(mode="budget0")
    result.baseline = lossless.compare_result(result, baseline, spec)
    return result


def ids(report: RunReport) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in findings.analyse(report):
        out.setdefault(item.id, []).append(item.severity)
    return out


def test_structured_output_broken_is_judged_against_the_baseline():
    bad = answer('{"city": "Par', fmt=FORMAT)
    good = answer('{"city": "Paris", "population": 2}', fmt=FORMAT)
    only_speculation = compared(answer('{"city": "Par', fmt=FORMAT), good)
    assert only_speculation.baseline.baseline_structured["passed"] is True
    assert ids(RunReport(results=[only_speculation]))["structured-output-broken"] == ["error"]
    both = compared(answer('{"city": "Par', fmt=FORMAT), bad)
    assert ids(RunReport(results=[both]))["structured-output-broken"] == ["info"]
    assert ids(RunReport(results=[answer('{"city": "Par', fmt=FORMAT)]))["structured-output-broken"] == ["warning"]
    cut = compared(answer('{"city": "Paris", "population": 1111', fmt=FORMAT, finish="length"),
                   answer('{"city": "Paris", "population": 1111', fmt=FORMAT, finish="length"))
    found = [f for f in findings.analyse(RunReport(results=[cut])) if f.id == "structured-output-broken"]
    assert [f.severity for f in found] == ["info"] and "max_tokens" in found[0].title
    healthy = compared(answer('{"city": "Paris", "population": 2}', fmt=FORMAT), good)
    assert "structured-output-broken" not in ids(RunReport(results=[healthy]))


def test_tool_calls_take_part_in_the_lossless_comparison():
    a = answer(calls=[call("get_weather", {"city": "Paris"})], tools=TOOLS, choice="required")
    b = answer(calls=[call("get_weather", {"city": "Lyon"})], tools=TOOLS, choice="required")
    record = lossless.compare_result(a, b, lossless.BaselineSpec(mode="budget0"))
    assert record.verdict == "mismatch" and record.field == "tool_calls"
    assert lossless.compare_result(a, a, lossless.BaselineSpec(mode="budget0")).verdict == "identical"


@pytest.mark.parametrize("content, reasoning, base_content, base_reasoning, expected", [
    ("<think>Let me add.</think>\n\n8 euros.", None, "8 euros.", "Let me add.", ["error"]),
    ("Let me add.</think>8 euros.", None, "Let me add.</think>8 euros.", None, ["warning"]),
    ("8 euros.", None, "8 euros.", "Let me add.", ["error"]),
    ("8 euros.", "Let me add.", "8 euros.", "Let me add.", None),
])
def test_reasoning_in_content_against_the_baseline(content, reasoning, base_content, base_reasoning, expected):
    result = compared(answer(content, thinking=True, reasoning=reasoning),
                      answer(base_content, thinking=True, reasoning=base_reasoning))
    assert ids(RunReport(results=[result])).get("reasoning-in-content") == expected
    off = compared(answer(content, thinking=False), answer(base_content, thinking=False))
    assert "reasoning-in-content" not in ids(RunReport(results=[off]))


def long_case(context, acceptance, *, budget=64, garbage_text=None) -> ProbeResult:
    result = answer(garbage_text or "A clear answer about the document.", context_tokens=context, tree_budget=budget)
    if context is not None:
        result.case.fill = {"tokens": context - 10, "estimated": False, "question": "q"}
    result.spec = SpecMetrics(decode_rounds=10, mean_acceptance_length=acceptance)
    result.timings = Timings(ttft_s=0.01 * (1 + (context or 0) / 1000))
    return result


def test_acceptance_falls_with_context_needs_a_clear_margin():
    falling = [long_case(None, 3.4), long_case(2048, 3.0), long_case(8192, 1.5)]
    found = findings.analyse(RunReport(results=falling))
    hit = [f for f in found if f.id == "acceptance-falls-with-context"]
    assert len(hit) == 1 and "1.50 at 8192 tokens vs 3.40 at the prompt as written" in hit[0].evidence
    assert hit[0].cases == [falling[2].case_id]
    gentle = [long_case(None, 3.4), long_case(8192, 2.9)]
    assert "acceptance-falls-with-context" not in ids(RunReport(results=gentle))
    one_length = [long_case(8192, 3.4), long_case(8192, 1.2)]
    assert "acceptance-falls-with-context" not in ids(RunReport(results=one_length))
    rows = workloads.context_table(falling)
    assert [(r["tokens"], r["acceptance"]) for r in rows] == [(0, 3.4), (2038, 3.0), (8182, 1.5)]
    assert rows[0]["label"] == "as written" and rows[2]["label"] == "8182 tokens"
    # prompts filled to one size share a row (their own words differ by a few tokens)
    other = long_case(8192, 2.5)
    other.case.fill["tokens"] = 8190
    rows = workloads.context_table([*falling, other])
    assert [(r["tokens"], r["cases"], r["acceptance"]) for r in rows][-1] == (8186, 2, 2.0)


def pair(first_cached, repeat_cached, *, repeat_text="Paris.", prompt_tokens=2000, baseline=None):
    results = []
    for role, cached, text in (("first", first_cached, "Paris."), ("repeat", repeat_cached, repeat_text)):
        result = answer(text, cache_role=role, context_tokens=2000)
        result.prompt_tokens, result.cached_tokens = prompt_tokens, cached
        result.timings = Timings(ttft_s=0.5 if role == "first" else 0.45)
        results.append(result)
    report = RunReport(results=results)
    if baseline is not None:
        for result, cached in zip(results, baseline, strict=True):
            probe = answer(result.output, cache_role=result.case.cache_role, context_tokens=2000, tree_budget=0)
            probe.prompt_tokens, probe.cached_tokens = prompt_tokens, cached
            probe.extras["baseline_of"] = result.case_id
            report.baseline_probes.append(probe)
    return report


def test_prefix_cache_lost_only_when_the_baseline_reuses():
    lost = pair(0, 0, baseline=(1984, 1984))
    found = [f for f in findings.analyse(lost) if f.id == "prefix-cache-lost-with-speculation"]
    assert len(found) == 1 and "0/2000 prompt tokens cached" in found[0].evidence
    assert found[0].cases == [lost.results[1].case_id]
    assert "prefix-cache-lost-with-speculation" not in ids(pair(0, 1984, baseline=(0, 1984)))
    assert "prefix-cache-lost-with-speculation" not in ids(pair(0, 0, baseline=(0, 0)))  # no cache at all
    assert "prefix-cache-lost-with-speculation" not in ids(pair(0, 0))  # no baseline to compare with


def test_a_cache_hit_judged_by_ttft_when_no_counter_says():
    repeat = answer("x", cache_role="repeat")
    repeat.timings = Timings(ttft_s=0.04)
    assert workloads.cache_hit(repeat, 0.5) == (True, "TTFT 40 ms vs 500 ms cold")
    repeat.timings = Timings(ttft_s=0.45)
    assert workloads.cache_hit(repeat, 0.5)[0] is False
    assert workloads.cache_hit(repeat, 0.05)[0] is None  # a cold prefill too short to measure


def test_without_cache_counters_each_side_is_judged_against_its_own_first():
    """No prefix cache anywhere (the in-process engine): a prefill without a draft is simply faster,
    so the baseline's repeat must not read as a hit against the speculative side's cold TTFT."""
    report = pair(None, None, baseline=(None, None))
    ttfts = {"first": 0.52, "repeat": 0.50}
    for result in report.results:
        result.timings = Timings(ttft_s=ttfts[result.case.cache_role])
    for probe in report.baseline_probes:
        probe.timings = Timings(ttft_s=0.22 if probe.case.cache_role == "first" else 0.21)
    assert "prefix-cache-lost-with-speculation" not in ids(report)
    report.baseline_probes[1].timings = Timings(ttft_s=0.02)  # the baseline's repeat really hit
    assert "prefix-cache-lost-with-speculation" in ids(report)


def test_prefix_cache_changes_output_names_the_divergence():
    report = pair(0, 1984, repeat_text="Lyon.")
    found = [f for f in findings.analyse(report) if f.id == "prefix-cache-changes-output"]
    assert len(found) == 1 and found[0].severity == "error" and "output differs at character 0" in found[0].evidence
    assert "prefix-cache-changes-output" not in ids(pair(0, 1984))


def test_workload_records_round_trip_through_the_json_report():
    result = answer('{"city": "Par', fmt=FORMAT, calls=None, context_tokens=2048, cache_role="first")
    result.cached_tokens, result.case.fill = 12, {"tokens": 2040, "estimated": True, "question": "q"}
    result.baseline = BaselineComparison(mode="budget0", verdict="identical", baseline_structured={"passed": True},
                                         baseline_reasoning_leak=False)
    report = RunReport(results=[result], baseline_probes=[answer("x")])
    again = RunReport.from_dict(json.loads(json.dumps(report.to_dict())))
    back = again.results[0]
    assert back.structured == result.structured and back.cached_tokens == 12 and back.case.fill == result.case.fill
    assert back.case.case_id == "p/ctx=2048/cache=first/think=default/budget=default/T=0/max=48/r0"
    assert back.baseline.baseline_structured == {"passed": True} and len(again.baseline_probes) == 1
    assert back.case.prompt_text == "q"
