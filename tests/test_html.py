"""The HTML report and diff page: self-contained, escaped, the same cells as the other formats,
the plots, the CLI routes to them (`report --format html`, `--html` on probe/gate, `diff --html`),
and a real headless Chromium that loads them without a single console message."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ddtree_diag.output.cells import acceptance_cell, fmt, quality_cell
from ddtree_diag.output.diff import diff_runs
from ddtree_diag.output.html import CSP, html_diff, html_report
from ddtree_diag.output.reportfile import load_report, write_report
from ddtree_diag.output.svg import axis, clean, esc, nice_ceiling
from tests.support import browser
from tests.support.reportkit import HOSTILE, slower_copy, varied_report

ACTIVE_TAGS = {"script", "img", "link", "iframe", "object", "embed", "base", "form", "video", "audio", "source"}


class Elements(HTMLParser):
    """Every start tag with its attributes, as a browser's parser would see them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def count(self, tag: str) -> int:
        return sum(1 for t, _ in self.tags if t == tag)


def assert_self_contained_and_inert(page: str) -> Elements:
    parsed = Elements(page)
    tags = {t for t, _ in parsed.tags}
    assert not tags & ACTIVE_TAGS, tags & ACTIVE_TAGS
    for tag, attrs in parsed.tags:
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)  # no event handler survived escaping
            assert name not in ("src", "href", "srcset", "action"), (tag, name)  # nothing to fetch
            if name == "style":
                assert "url(" not in (value or "")
    assert "url(" not in page.split("<style>", 1)[1].split("</style>", 1)[0]  # no font, no image
    assert f'content="{CSP}"' in page
    return parsed


@pytest.mark.unit
def test_report_page_escapes_server_text_and_loads_nothing():
    report = varied_report()
    page = html_report(report, 1)
    parsed = assert_self_contained_and_inert(page)
    text = "".join(parsed.text)
    # the hostile output is there as text, not as markup; control characters are made visible
    assert '<script>alert("x")</script><img src=x onerror="alert(1)">' in text
    assert "\\x1b[31mred" in text and "\\x00" in text and "\\ud800" in text and "\x00" not in page
    assert "Qwen3-8B<script>" in text  # the model name too
    page.encode("utf-8")  # a lone surrogate from a server cannot break writing the file


@pytest.mark.unit
def test_report_page_reads_like_the_other_formats():
    report = varied_report()
    parsed = Elements(html_report(report, 1))
    text = " ".join(parsed.text)
    assert "ddtree-diag gate: ✗ failed" in text and "exit 1" in text
    rows = [attrs.get("id") for tag, attrs in parsed.tags if tag == "tr" and (attrs.get("id") or "").startswith("case")]
    assert rows == [f"case-{i}" for i in range(1, len(report.results) + 1)]
    for result in report.results:
        assert quality_cell(result).text in text  # the same cells as the console and Markdown
        if result.ok:
            assert acceptance_cell(result).text in text
            assert fmt(result.timings.decode_tokens_per_second, ".1f") in text
    assert "✗ mismatch @1234" in text and "≈ near-tie @7" in text
    for finding in report.findings:
        assert finding.title in text and finding.evidence in text
    for check in report.gate.checks:
        assert check.detail in text
    assert "degenerate_enumeration" in text and "expected: …meet ⟨you." in text


@pytest.mark.unit
def test_report_page_plots():
    report = varied_report()
    parsed = Elements(html_report(report, 1))
    titles = [t for t in parsed.text if t.strip()]
    captions = " ".join(titles)
    assert "Mean acceptance by budget × thinking" in captions
    assert "Client decode tok/s by budget" in captions and "Server tok/s by budget" in captions
    with_rounds = [r for r in report.results if r.ok and r.spec.acceptance_lengths]
    # three budget charts, the acceptance-by-depth curves and one per-round histogram per case that
    # reported its rounds
    assert parsed.count("svg") == 4 + len(with_rounds)
    # one bar per known (budget, thinking) cell, drawn at its mean
    bars = [a for t, a in parsed.tags if t == "rect" and a.get("height") and a.get("width") == "24"]
    assert len(bars) >= 4
    assert "4 rounds · mean 3.00" in captions and "7 rounds · mean 2.00" in captions
    assert "1 successful case(s) without per-round numbers" not in captions


@pytest.mark.unit
def test_report_page_without_spec_numbers_says_so():
    report = varied_report()
    for result in report.results:
        result.spec.mean_acceptance_length = None
        result.spec.acceptance_lengths = None
        result.spec.server_tokens_per_second = None
    text = " ".join(Elements(html_report(report)).text)
    assert "The target reported no acceptance numbers." in text
    assert "did not report per-round acceptance lengths" in text
    assert "Client decode tok/s by budget" in text and "Mean acceptance by budget" not in text


@pytest.mark.unit
def test_diff_page():
    a = varied_report()
    b = slower_copy(a)
    page = html_diff(diff_runs(a, b), "runs/a.json", "runs/<b>.json")
    parsed = assert_self_contained_and_inert(page)
    text = " ".join(parsed.text)
    assert "regression(s)" in text and "acceptance 3.00 → 2.50 (-0.50)" in text
    assert "runs/<b>.json" in text and "A: Hello! It is nice to meet you." in text
    assert parsed.count("svg") == 2  # acceptance and tok/s, A vs B per case
    disjoint = slower_copy(a)
    for result in disjoint.results:
        result.case.prompt_id = "other"
    text = " ".join(Elements(html_diff(diff_runs(a, disjoint), "a", "b")).text)
    assert "The two runs share no cases" in text


@pytest.mark.unit
def test_axis_and_escaping_helpers():
    assert [nice_ceiling(v) for v in (0.3, 1, 1.2, 3.4, 7, 41)] == [0.5, 1, 2, 5, 10, 50]
    assert axis(3.4) == (4.0, [0.0, 1.0, 2.0, 3.0, 4.0]) and axis(0)[0] == 1.0
    assert esc('<a href="x">&\'') == "&lt;a href=&quot;x&quot;&gt;&amp;&#x27;"
    assert clean("a\x00b\x1b\ud800\ufffe\n\t") == "a\\x00b\\x1b\\ud800\\ufffe\n\t"


# ---- the CLI routes ----------------------------------------------------------------------------


@pytest.fixture
def saved_runs(tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report = varied_report()
    write_report(report, str(a))
    write_report(slower_copy(report), str(b))
    return a, b


def test_report_format_html_and_diff_html(saved_runs, cli, tmp_path):
    a, b = saved_runs
    out = tmp_path / "run.html"
    result = cli("report", str(a), "--format", "html", "-o", str(out))
    # the run's own exit code (a transport error: 3); the page went to the file
    assert result.code == 3 and result.stdout == ""
    assert html_report(load_report(a), 3) == out.read_text(encoding="utf-8")
    to_stdout = cli("report", str(a), "-f", "html")
    assert to_stdout.stdout.startswith("<!DOCTYPE html>")
    page = tmp_path / "diff.html"
    diffed = cli("diff", str(a), str(b), "--html", str(page))
    assert diffed.code == 1 and "regression:" in diffed.stdout
    assert "acceptance 3.00 → 2.50" in page.read_text(encoding="utf-8")


def test_probe_and_gate_write_html(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree")
    probe = cli("probe", "--url", server.url, "--html", str(tmp_path / "probe.html"), "--json",
                str(tmp_path / "probe.json"))
    gate = cli("gate", "gate", "--url", server.url, "--html", str(tmp_path / "gate.html"), "--max-tokens", "16")
    assert probe.code == 0, probe.stderr
    page = (tmp_path / "probe.html").read_text(encoding="utf-8")
    report = json.loads((tmp_path / "probe.json").read_text())
    assert "ddtree-diag probe: ✓ passed" in page
    assert all(r["case"]["case_id"].replace("/", "/<wbr>") in page for r in report["results"])
    assert gate.code == 0, gate.stderr
    assert "ddtree-diag gate: ✓ passed" in (tmp_path / "gate.html").read_text(encoding="utf-8")


# ---- a real browser ----------------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(browser.chromium() is None, reason=browser.MISSING)


@pytest.mark.e2e
@needs_chromium
def test_chromium_reports_console_errors_of_a_broken_page(tmp_path):
    """The check itself can fail: a script error, a console.error and a blocked fetch are seen."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                   "content=\"default-src 'none'; script-src 'unsafe-inline'\"></head><body><p>x</p>"
                   '<img src="http://example.invalid/a.png">'
                   '<script>console.error("boom"); undefined_function();</script></body></html>')
    page = browser.load(bad)
    assert page.returncode == 0 and "<p>x</p>" in page.dom
    joined = "\n".join(page.console)
    assert '"boom"' in joined and "undefined_function is not defined" in joined
    assert "Content Security Policy" in joined  # the image was refused, not fetched


@pytest.mark.e2e
@needs_chromium
def test_report_and_diff_pages_render_in_chromium_without_console_messages(tmp_path):
    # the pages the CLI writes (test_report_format_html_and_diff_html checks it is these)
    report = varied_report()
    report_page, diff_page = tmp_path / "run.html", tmp_path / "diff.html"
    report_page.write_text(html_report(report, 3), encoding="utf-8")
    diff_page.write_text(html_diff(diff_runs(report, slower_copy(report)), "a.json", "b.json"), encoding="utf-8")
    rendered = {}
    for path, charts in ((report_page, 4 + 4), (diff_page, 2)):  # the depth curves: one more svg
        page = browser.load(path)
        assert page.returncode == 0
        assert page.console == [], page.console
        dom = Elements(page.dom)
        assert dom.count("svg") == charts and dom.count("table") >= 1
        assert not {t for t, _ in dom.tags} & ACTIVE_TAGS  # the hostile text stayed text
        rendered[path] = page.dom
    assert "&lt;script&gt;alert(" in rendered[report_page] and HOSTILE.split("\n")[1][:8] in rendered[report_page]
