"""Acceptance by depth: P(the draft token at depth k is accepted) from every shape a server reports
it in, stored per case, pooled per budget × thinking group, shown in the console and the HTML, and
the ``acceptance-capped-at-depth`` finding: it fires when rounds pile up at one length although
the draft goes deeper (the stand-in's ``--capped-depth``, over real HTTP), and stays quiet on a
healthy stand-in, on a smoothly decaying curve and on the embedded engine's real rounds."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from ddtree_diag.backends import depth
from ddtree_diag.backends.metrics import parse_spec_counters
from ddtree_diag.checks import findings
from ddtree_diag.checks.depth import ACCEPTANCE_CAPPED_AT_DEPTH, acceptance_capped_at_depth
from ddtree_diag.output.console import render_report
from ddtree_diag.output.html import html_report
from ddtree_diag.output.svg import line_chart
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport, SpecMetrics
from tests.test_svg_labels import assert_no_overlap

CAPPED = ACCEPTANCE_CAPPED_AT_DEPTH.id

# Rounds of the embedded SmolLM2-135M + its DFlash draft (block size 8), recorded on CPU in fp32,
# thinking off, max_tokens 96 (loading and decoding them takes minutes on 2 cores, so they are kept).
ENGINE_ROUNDS = {
    16: [[6, 2, 1, 2, 1, 1, 1, 1, 1, 3, 2, 2, 2, 2, 3, 1, 3, 2, 2, 3, 2, 2, 3, 2, 2, 3, 1, 2, 2, 2, 1, 2, 5, 2,
          4, 1, 1, 1, 4, 3, 3, 5, 1],
         [4, 4, 4, 2, 3, 2, 1, 3, 3, 3, 3, 4, 2, 3, 5, 4, 2, 3, 4, 2, 2, 2, 2, 2, 4, 1, 2, 3, 3, 1, 2, 2, 7, 1]],
    64: [[6, 2, 2, 2, 2, 1, 2, 3, 3, 2, 3, 2, 1, 3, 2, 2, 3, 3, 2, 3, 1, 2, 3, 2, 1, 3, 2, 3, 4, 2, 4, 2, 2, 3,
          3, 3, 5, 1],
         [5, 4, 3, 2, 3, 3, 3, 3, 3, 4, 3, 3, 4, 6, 4, 3, 4, 2, 2, 3, 2, 5, 3, 5, 2, 1, 2, 8]],
}


def case(budget: int | None = 64, thinking: bool | None = False, repeat: int = 0) -> ProbeCase:
    return ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "Hi"}], enable_thinking=thinking,
                     tree_budget=budget, repeat=repeat)


def result(dialect: str, *, budget: int | None = 64, thinking: bool | None = False, repeat: int = 0,
           lengths: list[int] | None = None, extras: dict | None = None) -> ProbeResult:
    spec = SpecMetrics(acceptance_lengths=lengths, source=f"response.{dialect}" if lengths else None)
    if lengths:
        spec.decode_rounds, spec.mean_acceptance_length = len(lengths), sum(lengths) / len(lengths)
    return ProbeResult(case=case(budget, thinking, repeat), dialect=dialect, output="x", spec=spec,
                       extras=extras or {})


def run(*results: ProbeResult, **target) -> RunReport:
    report = RunReport(results=list(results), target={"dialect": results[0].dialect, **target})
    for each in report.results:
        depth.fill(each)
    return report


def vllm_extras(histogram: list[int], k: int | None = None, **more) -> dict:
    stats = {"acceptance_histogram": histogram, **({"num_spec_tokens": k} if k is not None else {}), **more}
    return {"metrics": {"speculative_decoding": stats}}


def capped_lengths(k: int, rounds: int) -> list[int]:
    """Every round accepts exactly k drafts, the last one fewer (cut at max_tokens)."""
    return [k + 1] * (rounds - 1) + [1]


# ---- the curve, from each shape --------------------------------------------------------------


def test_depth_from_per_round_lengths_counts_a_round_at_every_depth_it_passed():
    found = depth.from_lengths([1, 2, 3, 4])
    # a round of length L accepted L - 1 drafts: depth k is accepted iff L - 1 >= k
    assert found.rounds == 4 and found.accepted == (3.0, 2.0, 1.0) and found.limit is None
    assert found.probabilities == [0.75, 0.5, 0.25]
    # the curve adds up to the accepted draft tokens: sum over depths = sum over rounds of L - 1
    assert sum(found.accepted) == sum(n - 1 for n in [1, 2, 3, 4])
    assert depth.from_lengths([1, 1]).probabilities == [0.0]  # depth 1 never accepted
    assert depth.from_lengths([]) is None and depth.from_lengths([2, 0]) is None


def test_vllm_acceptance_histogram_as_its_docs_show_it():
    """vLLM docs (features/speculative_decoding/acceptance_metrics.md): index j counts the steps that
    accepted exactly j draft tokens, bonus excluded; dense, num_spec_tokens + 1 long."""
    extras = vllm_extras([39, 1, 0, 3], 3, num_spec_steps=43, num_accepted_draft_tokens=10,
                         mean_acceptance_length=1.2325581395348837)
    found = depth.case_depth(result("vllm", extras=extras))
    assert found.rounds == 43 and found.accepted == (4.0, 3.0, 3.0) and found.limit == 3
    assert sum(found.accepted) == 10  # num_accepted_draft_tokens
    assert 1 + sum(found.accepted) / found.rounds == pytest.approx(1.2325581395348837)
    assert found.source == "response.metrics.speculative_decoding.acceptance_histogram"
    # without num_spec_tokens the dense histogram's length says how deep a draft goes
    assert depth.case_depth(result("vllm", extras=vllm_extras([5, 0, 0, 0, 0]))).limit == 4


def test_vllm_per_step_accepted_is_read_first():
    """``detailed``: per_step_accepted is the accepted draft count of each step, in order."""
    extras = vllm_extras([1, 1, 1, 1], 3, per_step_accepted=[0, 3, 1, 0], per_step_drafted=[3, 3, 3, 3])
    found = depth.case_depth(result("vllm", extras=extras))
    assert found.rounds == 4 and found.accepted == (2.0, 1.0, 1.0) and found.limit == 3
    assert found.source.endswith("per_step_accepted")


@pytest.mark.parametrize("extras", [
    {"sglext": {"spec_tokens_details": {"spec_verify_ct": 2, "spec_num_correct_drafts": 2,
                                        "spec_correct_drafts_histogram": [1, 0, 1]}}},
    {"meta_info": {"spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 0, 1]}},
    {"meta_info": {"spec_verify_ct": 2, "spec_accept_histogram": [1, 0, 1]}},  # the older name
], ids=["sglext", "meta_info", "legacy"])
def test_sglang_correct_drafts_histogram(extras):
    """SGLang: index = correct drafts in a step, value = steps; it grows with the most drafts any
    step accepted, so it says nothing of how deep a draft goes."""
    found = depth.case_depth(result("sglang", extras=extras))
    assert found.rounds == 2 and found.probabilities == [0.5, 0.5] and found.limit is None


@pytest.mark.parametrize("prefix", ["vllm:", "llamacpp:"])
def test_per_position_counters_between_two_scrapes(prefix):
    """/metrics ``…_num_accepted_tokens_per_pos_total{position}``: position 0 = depth 1, per drafts;
    every exported position is one a draft reaches (vLLM exports 0 … num_speculative_tokens − 1)."""
    def page(drafts: int, accepted: int, per_pos: list[int]) -> str:
        lines = [f"{prefix}spec_decode_num_drafts_total{{engine=\"0\"}} {drafts}",
                 f"{prefix}spec_decode_num_draft_tokens_total{{engine=\"0\"}} {drafts * 4}",
                 f"{prefix}spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {accepted}"]
        lines += [f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{p}"}} {v}'
                  for p, v in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    before = parse_spec_counters(page(100, 150, [80, 50, 20, 0]))
    after = parse_spec_counters(page(120, 170, [100, 70, 20, 0]))
    spec = after.delta(before)
    assert spec.decode_rounds == 20 and spec.acceptance_by_depth == [1.0, 1.0, 0.0, 0.0]
    assert spec.acceptance_by_depth_rounds == 20 and spec.max_draft_depth == 4
    assert "server-wide" in spec.acceptance_by_depth_source and prefix in spec.acceptance_by_depth_source
    # a counter that went backwards says nothing
    assert depth.from_counters(before, after) is None


def test_pool_weights_cases_by_rounds_and_a_shorter_curve_counts_zero_past_its_end():
    short, long_ = depth.from_lengths([2, 2]), depth.from_lengths([1, 4, 4, 4])
    pooled = depth.pool([short, long_])
    assert pooled.rounds == 6 and pooled.accepted == (5.0, 3.0, 3.0)
    assert pooled.extended(None) is pooled and pooled.extended(3) is pooled
    assert pooled.extended(7).probabilities[-1] == 0.0 and len(pooled.extended(7).accepted) == 4
    assert depth.curve_text(pooled.extended(7)) == ".83 .50 .50 0"
    assert [depth.short(p) for p in (0.0, 0.004, 0.5, 0.996, 1.0)] == ["0", "<.01", ".50", ".99", "1"]


def test_the_curve_is_stored_in_the_report_and_older_reports_still_load():
    report = run(result("ddtree", lengths=[3, 2, 1, 3]))
    spec = report.results[0].spec
    assert spec.acceptance_by_depth == [0.75, 0.5] and spec.acceptance_by_depth_rounds == 4
    assert spec.acceptance_by_depth_source == "response.ddtree.acceptance_lengths"
    again = RunReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.results[0].spec.acceptance_by_depth == [0.75, 0.5]
    # a report written before the curve existed: no such fields, the curve is worked out again
    old = report.to_dict()
    for key in ("acceptance_by_depth", "acceptance_by_depth_rounds", "acceptance_by_depth_source", "max_draft_depth"):
        del old["results"][0]["spec"][key]
    loaded = RunReport.from_dict(old).results[0]
    assert loaded.spec.acceptance_by_depth is None
    assert depth.case_depth(loaded).probabilities == [0.75, 0.5]
    # junk where a curve should be is ignored, not trusted
    loaded.spec.acceptance_by_depth, loaded.spec.acceptance_by_depth_rounds = ["x", 2], 4
    assert depth.case_depth(loaded).probabilities == [0.75, 0.5]


# ---- the finding -----------------------------------------------------------------------------


def capped_report(dialect: str, k: int = 2, rounds: int = 14, **target) -> RunReport:
    out = []
    for budget in (16, 64):
        for repeat in (0, 1):
            lengths = capped_lengths(k, rounds)
            if dialect == "vllm":
                histogram = [0] * 5
                for n in lengths:
                    histogram[n - 1] += 1
                out.append(result("vllm", budget=budget, repeat=repeat, extras=vllm_extras(histogram, 4)))
            else:
                out.append(result(dialect, budget=budget, repeat=repeat, lengths=lengths))
    return run(*out, **target)


@pytest.mark.parametrize("dialect", ["ddtree", "vllm", "llamacpp"])
def test_fires_on_rounds_that_never_pass_depth_2(dialect):
    found = acceptance_capped_at_depth(capped_report(dialect))
    assert [f.id for f in found] == [CAPPED] and found[0].severity == "error"
    item = found[0]
    assert "depth 2 accepted in 93 % of 28 rounds, depth 3 in none" in item.evidence
    assert "acceptance stops dead at depth 2" in item.title
    assert "num_speculative_tokens" in item.check and "position ids" in item.check and "block_size" in item.check
    assert len(item.cases) == 4


def test_the_engine_judges_by_its_block_size():
    # capped at 2 with a block of 8: a bug; rounds that always fill the block (depth 7): its limit
    assert acceptance_capped_at_depth(capped_report("engine", block_size=8, backend="engine"))
    full = run(*(result("engine", budget=64, repeat=r, lengths=[8] * 30) for r in (0, 1)),
               block_size=8, backend="engine")
    assert acceptance_capped_at_depth(full) == []
    # a block of 3 drafts at most 2 tokens: capped at 2 is what it can do
    assert acceptance_capped_at_depth(capped_report("engine", block_size=3, backend="engine")) == []


def test_quiet_where_most_rounds_drafted_no_deeper():
    """vLLM with variable-length drafting (n-gram or suffix: per_step_drafted): rounds that drafted
    two tokens cannot accept a third, whatever num_speculative_tokens allows; rounds that drafted
    four and never passed depth 2 are the bug."""
    def case(repeat, drafted):
        steps = [2] * 29 + [0]
        return result("vllm", repeat=repeat, extras=vllm_extras(
            [1, 0, 29, 0, 0], 4, per_step_accepted=steps, per_step_drafted=drafted))

    short_drafts = run(*(case(r, [2] * 25 + [4] * 5) for r in (0, 1)))
    assert short_drafts.results[0].spec.max_draft_depth == 2
    assert acceptance_capped_at_depth(short_drafts) == []
    full_drafts = run(*(case(r, [4] * 30) for r in (0, 1)))
    assert full_drafts.results[0].spec.max_draft_depth == 4
    assert [f.id for f in acceptance_capped_at_depth(full_drafts)] == [CAPPED]


def test_quiet_at_the_servers_own_draft_length():
    """vLLM with num_speculative_tokens = 2: every round accepting both is a strong draft."""
    report = run(*(result("vllm", repeat=r, extras=vllm_extras([0, 1, 29], 2)) for r in (0, 1)))
    assert report.results[0].spec.max_draft_depth == 2
    assert acceptance_capped_at_depth(report) == []


def test_quiet_when_nothing_says_how_deep_the_draft_goes():
    """SGLang's histogram ends where the rounds do, and its draft length is a server setting."""
    extras = {"sglext": {"spec_tokens_details": {"spec_verify_ct": 14, "spec_correct_drafts_histogram": [1, 0, 13]}}}
    report = run(*(result("sglang", repeat=r, extras=extras) for r in (0, 1)))
    assert depth.groups(report)[0][2].probabilities == [pytest.approx(13 / 14, abs=1e-5)] * 2
    assert acceptance_capped_at_depth(report) == []
    # nor for a ddtree server asked for a budget of 2 (a tree of 2 nodes reaches depth 2 at most)
    small = run(*(result("ddtree", budget=2, repeat=r, lengths=capped_lengths(2, 14)) for r in (0, 1)))
    assert acceptance_capped_at_depth(small) == []


def test_quiet_on_a_smoothly_decaying_curve_and_a_weak_draft():
    smooth = [3, 2, 4, 3, 1, 5, 2, 3, 4, 3, 6, 2, 3, 7]  # 93 71 43 21 14 7 %: a strong, healthy draft
    assert acceptance_capped_at_depth(run(*(result("ddtree", repeat=r, lengths=smooth) for r in (0, 1)))) == []
    weak = [1, 2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 2]  # depth 1 at 29 %, depth 2 never
    assert acceptance_capped_at_depth(run(*(result("ddtree", repeat=r, lengths=weak) for r in (0, 1)))) == []
    # capped, but over too few rounds to say "never"
    assert acceptance_capped_at_depth(run(result("ddtree", lengths=capped_lengths(2, 8)))) == []


def test_quiet_on_the_embedded_engines_real_rounds():
    report = run(*(result("engine", budget=budget, repeat=r, lengths=lengths)
                   for budget, cases in ENGINE_ROUNDS.items() for r, lengths in enumerate(cases)),
                 block_size=8, backend="engine")
    assert acceptance_capped_at_depth(report) == []
    for _label, _results, pooled in depth.groups(report):
        curve = pooled.probabilities
        assert curve[0] > curve[1] > curve[2] > curve[3] > 0  # decays, never drops dead


def test_the_rule_is_registered_and_quiet_on_every_other_report():
    assert acceptance_capped_at_depth in findings.RULES and CAPPED in findings.BY_ID
    assert CAPPED not in findings.CRITICAL_FINDINGS
    assert acceptance_capped_at_depth(RunReport()) == []


# ---- the reports -----------------------------------------------------------------------------


def test_console_shows_a_small_table_per_group_and_the_html_a_curve():
    report = capped_report("vllm")
    findings.analyse(report)
    console = Console(file=io.StringIO(), width=80, no_color=True, color_system=None, highlight=False, emoji=False)
    render_report(console, report)
    out = console.file.getvalue()
    assert "acceptance by depth" in out and max(len(line) for line in out.splitlines()) <= 80
    assert re.search(r"budget=16 think=off\s*\|\s*28\s*\|\s*\.93 \.93 0 0", out), out
    assert "acceptance_histogram" in out  # where it came from
    page = html_report(report)
    assert "Acceptance by draft depth" in page and page.count("<polyline") == 2  # one line per group
    assert_no_overlap(page)
    # nothing per depth: no table, no curve
    plain = run(result("openai"))
    console = Console(file=io.StringIO(), width=120, no_color=True)
    render_report(console, plain)
    assert "acceptance by depth" not in console.file.getvalue()
    assert "Acceptance by draft depth" not in html_report(plain)


@pytest.mark.parametrize("series", [1, 3, 8])
@pytest.mark.parametrize("depths", [2, 7, 15, 40])
def test_line_chart_labels_never_overlap(series, depths):
    lines = [(f"budget={2 ** s} think={'on' if s % 2 else 'off'} with a long name", [
        None if (d + s) % 6 == 5 else 1 / (1 + d + s) for d in range(depths - s % 3)]) for s in range(series)]
    svg = line_chart([str(d) for d in range(1, depths + 1)], lines, title="t", y_label="P", x_label="draft depth",
                     y_max=1.0)
    assert assert_no_overlap(svg) == 1


# ---- over real HTTP ----------------------------------------------------------------------------

# Thinking off, budgets 16 and 64, two repeats: 4 requests, 2 groups of 2 × 14 rounds.
MATRIX = """
[defaults]
max_tokens = 64
temperature = 0.0
repeat = 2

[axes]
enable_thinking = [false]
tree_budget = [16, 64]

[prompts.hello]
text = "Say hello in one short sentence."
"""
ANSWER = " ".join(f"word{i}." for i in range(40))  # 40 tokens: 14 rounds of 3


def probe(standin, cli, tmp_path, dialect: str, *flags: str) -> tuple[RunReport, str]:
    server = standin("--dialect", dialect, "--answer", ANSWER, *flags)
    matrix = tmp_path / "m.toml"
    matrix.write_text(MATRIX)
    out = tmp_path / "run.json"
    done = cli("probe", "--url", server.url, "--matrix", str(matrix), "--json", str(out), "-q")
    assert done.code == 0 and out.exists(), done.stderr
    return RunReport.from_dict(json.loads(out.read_text())), done.stdout


@pytest.mark.parametrize("dialect", ["ddtree", "vllm", "llamacpp"])
def test_fires_against_a_server_capped_at_depth_2(standin, cli, tmp_path, dialect):
    report, stdout = probe(standin, cli, tmp_path, dialect, "--capped-depth", "2")
    item = next(f for f in report.findings if f.id == CAPPED)
    assert item.severity == "error" and item.title in stdout
    assert sorted(item.cases) == sorted(r.case_id for r in report.results)
    assert all(CAPPED in r.findings for r in report.results)
    for each in report.results:  # stored per case, in the JSON: .93 .93, then never
        assert each.spec.acceptance_by_depth[:2] == [pytest.approx(13 / 14, abs=1e-3)] * 2
        assert all(p == 0 for p in each.spec.acceptance_by_depth[2:])
    assert "acceptance by depth" in stdout and ".93 .93 0" in stdout


def test_sglang_shows_the_cap_but_cannot_say_the_draft_goes_deeper(standin, cli, tmp_path):
    report, stdout = probe(standin, cli, tmp_path, "sglang", "--capped-depth", "2")
    assert report.results[0].spec.acceptance_by_depth == [pytest.approx(13 / 14, abs=1e-3)] * 2
    assert report.results[0].spec.max_draft_depth is None
    assert CAPPED not in [f.id for f in report.findings] and ".93 .93" in stdout


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp"])
def test_a_healthy_stand_in_decays_smoothly_and_is_quiet(standin, cli, tmp_path, dialect):
    report, stdout = probe(standin, cli, tmp_path, dialect)
    assert CAPPED not in [f.id for f in report.findings]
    for _label, _results, pooled in depth.groups(report):
        curve = pooled.probabilities
        assert curve[0] > curve[1] > curve[2] > curve[3] > 0 and pooled.rounds == 28
    assert "acceptance by depth" in stdout
