"""A fleet's report in every format (``output/fleetview.py``): the console table and --detail,
Markdown with a folded section per target, one HTML page with a section per target, JUnit with a
suite per target plus the fleet's; secrets masked everywhere. Built from records alone: three
targets (one passed, one failed with garbage, one unreachable) and a cross-target finding."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest

from ddtree_diag.output import fleetview
from ddtree_diag.output.console import make_console, summary_line
from ddtree_diag.output.fleetview import (
    DETAIL_HINT,
    fleet_junit_xml,
    fleet_markdown,
    fleet_summary_line,
    html_fleet,
    render_fleet,
    write_fleet_junit,
    write_fleet_summary,
    write_html_fleet,
)
from ddtree_diag.output.junit import junit_xml
from ddtree_diag.records import (
    Finding,
    FleetMember,
    FleetReport,
    GateCheck,
    GateResult,
    ProbeCase,
    ProbeResult,
    RunReport,
)
from ddtree_diag.redaction import REDACTOR
from tests.support import browser
from tests.support.reportkit import HOSTILE, varied_report
from tests.test_html import ACTIVE_TAGS, Elements

NAMES = ["gpu-1", "gpu-2", "gpu-3"]
SECRET = "sk-fleet-secret-123"


def passed_run() -> RunReport:
    report = varied_report()
    report.results = report.results[:1]  # clean, identical to its baseline
    report.findings = []
    report.gate = GateResult(True, [GateCheck("max_garbage", True, "0 garbage cases <= 0 allowed")])
    report.target = {"url": "http://10.0.0.1:30000/v1", "model": "Qwen3-8B", "dialect": "ddtree"}
    return report


def garbage_run() -> RunReport:
    report = varied_report()  # a garbage case, a lossless mismatch, findings, a failed gate
    report.results = report.results[:4]  # without its transport error: failed, not unreachable
    report.target.update(url="http://10.0.0.2:30000/v1", model="Qwen3-8B")  # a replica of gpu-1
    return report


def unreachable_run() -> RunReport:
    case = ProbeCase(prompt_id="hello", messages=[{"role": "user", "content": "hello?"}], enable_thinking=False,
                     tree_budget=16, max_tokens=48)
    return RunReport(
        results=[ProbeResult(case=case, status="transport_error", error="connection refused by 10.0.0.3:30000")],
        target={"url": "http://10.0.0.3:30000/v1", "model": "Qwen3-8B"}, interrupted=True,
        stopped={"reason": "unreachable", "detail": "connection refused by 10.0.0.3:30000", "exit_code": 3},
    )


DIFFERS = Finding("replica-differs", "error", "gpu-2 answers differently from its replicas",
                  "hello/think=off/budget=64: gpu-2 differs from gpu-1 at character 1234",
                  "that every replica runs the same weights and build",
                  cases=["hello/think=off/budget=64/T=0/max=48/r0"])


def make_fleet(*, gate: bool = True) -> FleetReport:
    members = [FleetMember(name, run) for name, run in zip(NAMES, (passed_run(), garbage_run(), unreachable_run()),
                                                            strict=True)]
    fleet = FleetReport(targets=members, findings=[DIFFERS], matrix="smoke (built-in)",
                        started_at="2026-11-01T10:00:00+00:00", finished_at="2026-11-01T10:00:30+00:00")
    if gate:  # as fleet.judge builds it: one check per target, then the cross-target one
        fleet.gate = GateResult(False, [
            GateCheck("target gpu-1", True, "passed"),
            GateCheck("target gpu-2", False, "failed: max_garbage: 1 garbage case > 0 allowed"),
            GateCheck("target gpu-3", False, "unreachable: STOPPED, target unreachable (partial)"),
            GateCheck("replicas", False, f"[error] {DIFFERS.title}", DIFFERS.cases),
        ])
    return fleet


def console_text(fleet: FleetReport, *, detail: bool = False, width: int = 200, code: int = 3) -> str:
    buffer = io.StringIO()
    console = make_console(buffer, no_color=True)
    console.width = width
    render_fleet(console, fleet, code, detail=detail)
    return buffer.getvalue()


# ---- console -----------------------------------------------------------------------------------


def test_console_table_findings_gate_and_summary():
    text = console_text(make_fleet())
    table = text.split("cross-target findings:")[0]
    rows = {name: next(line for line in table.splitlines() if f" {name} " in line) for name in NAMES}
    assert "✓ passed" in rows["gpu-1"] and "1/1" in rows["gpu-1"] and "1 =" in rows["gpu-1"]
    assert "✗ failed" in rows["gpu-2"] and "max_garbage" in rows["gpu-2"] and "≠" in rows["gpu-2"]
    assert "1 error, 1 warning" in rows["gpu-2"]
    assert "✗ unreachable" in rows["gpu-3"] and "0/1" in rows["gpu-3"]
    assert "STOPPED, target unreachable" in rows["gpu-3"]
    for header in ("target", "status", "cases ok", "accept", "tok/s", "garbage", "lossless", "findings", "detail"):
        assert header in table
    assert "[error] gpu-2 answers differently from its replicas" in text
    assert DETAIL_HINT in text and "ddtree-diag gate" not in text  # no per-target report without --detail
    assert "✗ replicas: [error]" in text and "fleet gate: FAILED" in text
    last = text.rstrip().splitlines()[-1]
    assert last == fleet_summary_line(make_fleet(), 3)
    assert last == ("FLEET: 3 targets · 1 passed · 1 failed (gpu-2) · 1 unreachable (gpu-3) · "
                    "1 cross-target finding (1 error) · exit 3")
    # in the order a reader wants: the table, the fleet's findings, the gate, the verdict
    order = [text.index(s) for s in ("gpu-3", "cross-target findings:", DETAIL_HINT, "fleet gate:", "FLEET:")]
    assert order == sorted(order)


def test_console_fits_a_narrow_terminal_and_many_targets():
    fleet = make_fleet()
    narrow = console_text(fleet, width=80)
    assert all(name in narrow for name in NAMES)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    many = FleetReport(targets=[FleetMember(f"replica-{i:03d}.cluster.internal", passed_run()) for i in range(120)])
    text = console_text(many, width=120, code=0)
    assert all(f"replica-{i:03d}" in text for i in range(120))
    assert max(len(line) for line in text.splitlines()) <= 120
    assert text.rstrip().splitlines()[-1] == "FLEET: 120 targets · 120 passed · exit 0"


def test_console_detail_shows_every_target_under_its_rule():
    fleet = make_fleet()
    text = console_text(fleet, detail=True)
    assert DETAIL_HINT not in text
    starts = [text.index(f"target {name}") for name in NAMES]
    assert starts == sorted(starts)
    assert text.index("cross-target findings:") < starts[0] and starts[-1] < text.index("fleet gate:")
    for name, start, end in zip(NAMES, starts, [*starts[1:], len(text)], strict=True):
        section = text[start:end]
        member = fleet.member(name)
        code = {"gpu-1": 0, "gpu-2": 1, "gpu-3": 3}[name]
        assert summary_line(member.report, code) in section  # its own single-run rendering
    gpu2 = text[starts[1]:starts[2]]
    assert "quality" in gpu2 and "✗ degenerate_enumeration" in gpu2 and "gate: FAILED" in gpu2
    assert "STOPPED, target unreachable" in text[starts[2]:]


def test_summary_line_names_at_most_five_and_says_a_fleet_was_stopped():
    fleet = FleetReport(targets=[FleetMember(f"t{i}", unreachable_run()) for i in range(8)], interrupted=True,
                        stopped={"reason": "interrupted", "exit_code": 130})
    assert fleet_summary_line(fleet, 130) == ("FLEET: 8 targets · 8 unreachable (t0, t1, t2, t3, t4, +3 more) · "
                                              "INTERRUPTED by Ctrl-C (partial) · exit 130")
    assert fleet_summary_line(FleetReport()) == "FLEET: 0 targets"
    assert "the fleet has no target" in console_text(FleetReport(), code=0)


def test_a_group_column_only_when_the_fleet_serves_more_than_one_model():
    fleet = make_fleet()
    assert " group " not in console_text(fleet) and "| group |" not in fleet_markdown(fleet, 3)
    fleet.targets[2].group = "canary"
    assert " group " in console_text(fleet) and "| target | group | status |" in fleet_markdown(fleet, 3)
    assert "<th>group</th>" in html_fleet(fleet, 3)


# ---- Markdown ----------------------------------------------------------------------------------


def test_markdown_table_findings_checks_and_a_folded_section_per_target():
    text = fleet_markdown(make_fleet(), 3)
    assert text.startswith("## ddtree-diag fleet gate: ❌ failed\n")
    assert "**Fleet:** 3 targets · 1 passed · 1 failed (gpu-2) · 1 unreachable (gpu-3)" in text
    assert "| target | status | cases ok | accept | tok/s | garbage | lossless | findings | detail |" in text
    rows = [line for line in text.splitlines() if line.startswith("| gpu-")]
    assert [r.split(" | ")[0][2:] for r in rows] == NAMES
    assert "| ✗ failed |" in rows[1] and "| ✗ unreachable |" in rows[2]
    assert "- **error** — gpu-2 answers differently from its replicas (`replica-differs`)" in text
    assert "| ❌ | replicas | [error] gpu-2 answers differently from its replicas |" in text
    for name, status in zip(NAMES, ("✓ passed", "✗ failed", "✗ unreachable"), strict=True):
        assert f"<details><summary>{name} — {status}</summary>" in text
    # each target's own summary, one heading level down, inside its <details>
    assert text.count("### ddtree-diag gate: ") == 2 and "### ddtree-diag probe: ❌ failed" in text
    assert "#### Cases" in text and text.index("### Fleet checks") < text.index("<details><summary>gpu-1")
    assert text.count("<details><summary>gpu-") == 3 and text.count("<details>") == text.count("</details>")


def test_markdown_of_a_probe_fleet_and_the_size_budget(monkeypatch):
    text = fleet_markdown(make_fleet(gate=False), 3)
    assert text.startswith("## ddtree-diag fleet probe: ❌ failed") and "### Fleet checks" not in text
    monkeypatch.setattr(fleetview, "MARKDOWN_DETAIL_BUDGET", 3_000)  # room for the failing targets only
    cut = fleet_markdown(make_fleet(), 3)
    assert "<details><summary>gpu-1" not in cut
    assert "<details><summary>gpu-2" in cut and "<details><summary>gpu-3" in cut
    assert "1 target(s) left out to keep the summary under GitHub's 1 MiB: gpu-1" in cut


def test_write_fleet_summary_appends_to_the_github_step_summary(tmp_path, monkeypatch):
    step = tmp_path / "step.md"
    step.write_text("earlier step\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    write_fleet_summary(make_fleet(), str(tmp_path / "fleet.md"), 3)
    written = (tmp_path / "fleet.md").read_text(encoding="utf-8")
    assert written == fleet_markdown(make_fleet(), 3)
    assert step.read_text(encoding="utf-8") == "earlier step\n" + written + "\n"
    write_fleet_summary(make_fleet(), None, 3)  # no file: the job summary only
    assert step.read_text(encoding="utf-8").count("## ddtree-diag fleet gate") == 2


# ---- HTML --------------------------------------------------------------------------------------


def test_html_page_fleet_first_then_a_section_per_target():
    fleet = make_fleet()
    fleet.targets[1].report.results[2].output = HOSTILE
    page = html_fleet(fleet, 3)
    parsed = Elements(page)
    assert not {t for t, _ in parsed.tags} & ACTIVE_TAGS and "<script" not in page
    ids = [a["id"] for _, a in parsed.tags if a.get("id")]
    assert len(ids) == len(set(ids))  # every target's sections got their own ids
    links = [a["href"] for t, a in parsed.tags if t == "a"]
    assert all(href.startswith("#") and href[1:] in ids for href in links)  # only links within the page
    sections = [a["id"] for t, a in parsed.tags if t == "section"]
    assert sections == ["target-1", "target-2", "target-3"]
    assert [f"#{s}" for s in sections] == [h for h in links if h != "#targets"][:3]
    # the fleet view (verdict, table, findings, gate) comes before the first target's section
    first = page.index('<section class="target" id="target-1">')
    for marker in ("ddtree-diag fleet gate: ✗ failed", 'id="targets"', 'id="fleet-findings"', 'id="fleet-checks"',
                   "gpu-2 answers differently from its replicas"):
        assert page.index(marker) < first
    text = " ".join(parsed.text)
    assert "gpu-1 · gate: ✓ passed" in text and "gpu-2 · gate: ✗ failed" in text
    assert "gpu-3 · probe: ✗ failed (STOPPED, target unreachable" in text
    assert "FLEET" not in text and "3 targets · 1 passed · 1 failed (gpu-2) · 1 unreachable (gpu-3)" in text
    # each target's own body, as html_report lays it out, with its ids prefixed
    gpu2 = page[page.index('id="target-2"'):page.index('id="target-3"')]
    for section in ("checks", "findings", "plots", "cases", "rounds", "notes"):
        assert f'<h3 id="target-2-{section}">' in gpu2
    assert [i for i in ids if i.startswith("target-2-case-")] == [f"target-2-case-{i}" for i in range(1, 5)]
    assert '<script>alert("x")</script>' in text and "✗ mismatch @1234" in text
    assert parsed.count("svg") >= 2  # acceptance and tok/s per target, besides the targets' own plots


def test_html_page_of_one_target_and_the_file(tmp_path):
    single = FleetReport(targets=[FleetMember("only", passed_run())])
    page = html_fleet(single, 0)
    assert "ddtree-diag fleet probe: ✓ passed" in page and 'id="fleet-plots"' not in page  # no chart of one bar
    write_html_fleet(make_fleet(), str(tmp_path / "fleet.html"), 3)
    assert (tmp_path / "fleet.html").read_text(encoding="utf-8") == html_fleet(make_fleet(), 3)


# ---- JUnit -------------------------------------------------------------------------------------


def _suites(xml: str) -> tuple[ET.Element, dict[str, ET.Element]]:
    root = ET.fromstring(xml.encode())
    return root, {s.get("name"): s for s in root.findall("testsuite")}


def test_junit_a_suite_per_target_and_the_fleet_gate(tmp_path):
    fleet = make_fleet()
    root, suites = _suites(fleet_junit_xml(fleet))
    assert list(suites) == [*NAMES, "fleet"]
    for name in NAMES:
        own = ET.fromstring(junit_xml(fleet.member(name).report).encode()).find("testsuite")
        suite = suites[name]
        assert (suite.get("tests"), suite.get("failures")) == (own.get("tests"), own.get("failures"))
        # the same testcases, their classes prefixed with the target's name
        assert [(c.get("classname"), c.get("name"), c.find("failure") is not None) for c in suite.iter("testcase")] \
            == [(c.get("classname").replace("ddtree-diag.", f"ddtree-diag.{name}.", 1), c.get("name"),
                 c.find("failure") is not None) for c in own.iter("testcase")]
    assert suites["gpu-1"].get("failures") == "0" and int(suites["gpu-2"].get("failures")) > 0
    fleet_cases = suites["fleet"].findall("testcase")
    assert [c.get("name") for c in fleet_cases] == [c.name for c in fleet.gate.checks]
    assert [c.find("failure") is not None for c in fleet_cases] == [False, True, True, True]
    assert suites["fleet"].get("failures") == "3"
    assert "gpu-2 answers differently" in suites["fleet"].findtext("system-out")
    for key in ("tests", "failures"):
        assert root.get(key) == str(sum(int(s.get(key)) for s in suites.values()))
    write_fleet_junit(fleet, str(tmp_path / "fleet.xml"))
    assert (tmp_path / "fleet.xml").read_text(encoding="utf-8") == fleet_junit_xml(fleet)


def test_junit_without_a_gate_fails_for_targets_and_error_findings():
    fleet = make_fleet(gate=False)
    fleet.findings.append(Finding("replica-slow", "warning", "gpu-1 is slower than its replicas", "41 vs 80 tok/s",
                                  "the GPU's clocks"))
    _, suites = _suites(fleet_junit_xml(fleet))
    cases = [(c.get("classname"), c.get("name"), c.find("failure") is not None)
             for c in suites["fleet"].findall("testcase")]
    assert cases == [
        ("ddtree-diag.fleet", "target gpu-1", False), ("ddtree-diag.fleet", "target gpu-2", True),
        ("ddtree-diag.fleet", "target gpu-3", True),
        ("ddtree-diag.fleet.replica-differs", DIFFERS.title, True),
        ("ddtree-diag.fleet.replica-slow", "gpu-1 is slower than its replicas", False),
    ]
    assert suites["fleet"].get("tests") == "5" and suites["fleet"].get("failures") == "3"
    types = [f.get("type") for f in suites["fleet"].iter("failure")]
    assert types == ["failed", "unreachable", "replica-differs"]


# ---- secrets and single runs -------------------------------------------------------------------


@pytest.fixture
def secret():
    REDACTOR.add(SECRET)
    yield SECRET
    REDACTOR.clear()


def test_every_format_masks_the_secrets(secret):
    fleet = make_fleet()
    fleet.targets[2].report.results[0].error = f"401 Unauthorized: Bearer {secret}"
    fleet.targets[0].report.target["url"] = f"http://user:{secret}@10.0.0.1/v1"
    fleet.notes.append(f"the key {secret} was read from FLEET_KEY")
    fleet.findings[0].evidence += f" ({secret})"
    outputs = [console_text(fleet, detail=True), fleet_markdown(fleet, 3), html_fleet(fleet, 3),
               fleet_junit_xml(fleet)]
    for text in outputs:
        assert secret not in text and "***" in text


def test_the_fleet_renderers_leave_the_single_run_ones_as_they_were():
    # the refactors (run_header/run_sections, add_suite, print_findings/print_gate, publish) keep
    # the single-run page's structure: one h1, h2 sections with plain ids, no section wrapper
    report = garbage_run()
    from ddtree_diag.output.html import html_report

    page = Elements(html_report(report, 1))
    assert page.count("h1") == 1 and page.count("section") == 0 and page.count("h3") == 0
    ids = [a.get("id") for _, a in page.tags if a.get("id")]
    assert ids[:3] == ["checks", "findings", "plots"] and "case-1" in ids
    root = ET.fromstring(junit_xml(report).encode())
    assert [s.get("name") for s in root.findall("testsuite")] == ["ddtree-diag gate"]
    assert all(c.get("classname").count(".") == 1 for c in root.iter("testcase"))


# ---- a real browser ----------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.skipif(browser.chromium() is None, reason=browser.MISSING)
def test_fleet_page_renders_in_chromium_without_console_messages(tmp_path):
    path = tmp_path / "fleet.html"
    path.write_text(html_fleet(make_fleet(), 3), encoding="utf-8")
    page = browser.load(path)
    assert page.returncode == 0 and page.console == [], page.console
    dom = Elements(page.dom)
    assert dom.count("section") == 3 and not {t for t, _ in dom.tags} & ACTIVE_TAGS


def test_fleet_json_is_built_a_target_at_a_time_with_the_same_text():
    from ddtree_diag import jsonsafe
    from ddtree_diag.output.reportfile import report_dict, report_json

    fleet = make_fleet()
    assert report_json(fleet) == jsonsafe.dumps(report_dict(fleet)) + "\n"
    fleet.targets[1].report.results[0].timings.e2e_s = float("nan")
    data = json.loads(report_json(fleet))
    assert data["targets"][1]["report"]["results"][0]["timings"]["e2e_s"] is None
    assert any("targets[1].report.results[0].timings.e2e_s" in n for n in data["targets"][1]["report"]["notes"])
    assert FleetReport.from_dict(data).targets[1].name == fleet.targets[1].name
