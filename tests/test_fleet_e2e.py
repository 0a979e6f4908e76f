"""Fleets end to end: the CLI against several STAND-IN servers (tests/support/standin_server.py,
real HTTP on loopback), one of them faulty, dead, slow or stuck; the fleet report, its exit code,
gate --against per target, report --merge / --target, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from tests.support.gatekit import write_matrix
from tests.support.processes import ROOT, free_port, run_cli, sigint_default
from tests.support.timing import AGAINST_SELF_TPS_TOLERANCE

pytestmark = pytest.mark.e2e

# A small matrix: one prompt, thinking off, one budget, greedy, a short answer.
SMALL = ["--prompt", "Say hello in one short sentence.", "--thinking", "off", "--budget", "16",
         "--max-tokens", "16"]


def _fleet(path) -> dict:
    return json.loads(path.read_text())


def _by_name(report: dict) -> dict[str, dict]:
    return {t["name"]: t for t in report["targets"]}


def _targets_file(tmp_path, rows: list[str]) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return str(path)


def test_healthy_fleet_of_repeated_urls(standin, tmp_path):
    servers = [standin("--dialect", "ddtree") for _ in range(3)]
    out = tmp_path / "fleet.json"
    result = run_cli("probe", *[a for s in servers for a in ("--url", s.url)], *SMALL, "--json", str(out))
    assert result.code == 0, result.stdout + result.stderr
    report = _fleet(out)
    assert report["kind"] == "fleet" and len(report["targets"]) == 3
    for member in report["targets"]:
        assert member["exit_code"] == 0
        assert len(member["report"]["results"]) == 1
        assert member["name"] in result.stdout  # the fleet table names every target
    assert not [f for f in report["findings"] if f["id"].startswith("replica")]
    # progress in a log names the target of every case
    names = [m["name"] for m in report["targets"]]
    assert all(any(line.startswith("[") and name in line for line in result.stderr.splitlines()) for name in names)


def test_the_replica_that_differs_is_named(standin, tmp_path):
    good = [standin("--dialect", "ddtree") for _ in range(2)]
    lossy = standin("--dialect", "ddtree", "--lossy")
    no_drafts = standin("--dialect", "ddtree", "--no-drafts")
    path = _targets_file(tmp_path, [
        '[defaults]', 'dialect = "ddtree"',
        '[[target]]', 'name = "good-{i}"', 'url = "http://127.0.0.1:{i}"',
        f'i = [{good[0].url.rsplit(":", 1)[1]}, {good[1].url.rsplit(":", 1)[1]}]',
        '[[target]]', 'name = "lossy"', f'url = "{lossy.url}"',
        '[[target]]', 'name = "no-drafts"', f'url = "{no_drafts.url}"',
    ])
    out, junit, summary = tmp_path / "f.json", tmp_path / "f.xml", tmp_path / "f.md"
    result = run_cli("probe", "--targets", path, *SMALL, "--json", str(out), "--junit", str(junit),
                     "--summary", str(summary))
    assert result.code == 1, result.stdout + result.stderr
    report = _fleet(out)
    differs = [f for f in report["findings"] if f["id"] == "replica-differs"]
    assert differs and all(f["severity"] == "error" for f in differs)
    text = " ".join(f["title"] for f in differs)
    assert "lossy" in text and "no-drafts" in text
    assert "good-" not in " ".join(f["title"] for f in differs if "lossy" not in f["title"]
                                    and "no-drafts" not in f["title"])
    suites = [s.get("name") for s in ET.parse(junit).getroot().iter("testsuite")]
    assert sum(any(name in (s or "") for s in suites) for name in ("lossy", "no-drafts", "good-")) == 3
    assert "lossy" in summary.read_text()


def test_dead_target_fails_alone_and_the_others_finish(standin, tmp_path):
    servers = [standin("--dialect", "ddtree") for _ in range(2)]
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "f.json"
    result = run_cli("probe", "--url", servers[0].url, "--url", dead, "--url", servers[1].url, *SMALL,
                     "--json", str(out))
    assert result.code == 3, result.stdout + result.stderr
    members = _by_name(_fleet(out))
    dead_name = dead.split("//")[1]
    assert members[dead_name]["exit_code"] == 3
    assert members[dead_name]["report"]["stopped"]["reason"] == "unreachable"
    for server in servers:
        assert len(members[server.url.split("//")[1]]["report"]["results"]) == 1
    assert "unreachable" in result.stdout and "Traceback" not in result.stderr


def test_stuck_target_stopped_at_its_deadline(standin, tmp_path):
    healthy = standin("--dialect", "ddtree")
    stuck = standin("--dialect", "ddtree", "--first-token-delay", "60")
    path = _targets_file(tmp_path, [
        '[[target]]', 'name = "healthy"', f'url = "{healthy.url}"',
        '[[target]]', 'name = "stuck"', f'url = "{stuck.url}"', "deadline = 1",
    ])
    out = tmp_path / "f.json"
    result = run_cli("probe", "--targets", path, *SMALL, "--json", str(out), timeout=50)
    assert result.code == 3, result.stdout + result.stderr
    members = _by_name(_fleet(out))
    assert members["stuck"]["report"]["stopped"]["reason"] == "deadline"
    assert "deadline" in result.stdout
    assert members["healthy"]["exit_code"] == 0


def test_gate_against_a_known_good_fleet_per_target(standin, tmp_path):
    a, b = standin("--dialect", "ddtree"), standin("--dialect", "ddtree")
    # a wide tok/s tolerance: the second run may be slower on a loaded machine
    matrix = write_matrix(tmp_path, extra=f"[gate]\nmax_garbage = 0\nagainst_tps_tolerance = "
                                          f"{AGAINST_SELF_TPS_TOLERANCE}\n")
    path = _targets_file(tmp_path, [
        '[[target]]', 'name = "a"', f'url = "{a.url}"', '[[target]]', 'name = "b"', f'url = "{b.url}"',
    ])
    good = tmp_path / "good.json"
    first = run_cli("gate", str(matrix), "--targets", path, "--max-tokens", "16", "--json", str(good))
    assert first.code == 0, first.stdout + first.stderr
    assert all(m["report"]["gate"]["passed"] for m in _fleet(good)["targets"])
    lossy = standin("--dialect", "ddtree", "--lossy")  # b is replaced by a lossy server
    path = _targets_file(tmp_path, [
        '[[target]]', 'name = "a"', f'url = "{a.url}"', '[[target]]', 'name = "b"', f'url = "{lossy.url}"',
    ])
    out = tmp_path / "now.json"
    again = run_cli("gate", str(matrix), "--targets", path, "--max-tokens", "16", "--against", str(good),
                    "--json", str(out))
    assert again.code == 1, again.stdout + again.stderr
    members = _by_name(_fleet(out))
    assert members["a"]["report"]["gate"]["passed"] is True, members["a"]["report"]["gate"]
    failed = [c["name"] for c in members["b"]["report"]["gate"]["checks"] if not c["passed"]]
    assert "against_text" in failed, failed
    gate = {c["name"]: c for c in _fleet(out)["gate"]["checks"]}
    assert gate["target a"]["passed"] and not gate["target b"]["passed"]
    # a target the known-good fleet does not have: exit 2 before any request
    path = _targets_file(tmp_path, ['[[target]]', 'name = "c"', f'url = "{a.url}"'])
    missing = run_cli("gate", str(matrix), "--targets", path, "--against", str(good))
    assert missing.code == 2 and "no target 'c'" in missing.stderr


def test_merge_runs_from_several_machines(standin, tmp_path):
    a, lossy = standin("--dialect", "ddtree"), standin("--dialect", "ddtree", "--lossy")
    c = standin("--dialect", "ddtree")
    runs = []
    for server in (a, lossy, c):
        path = tmp_path / f"{server.url.rsplit(':', 1)[1]}.json"
        run_cli("probe", "--url", server.url, *SMALL, "--json", str(path))
        runs.append(str(path))
    merged = tmp_path / "merged.json"
    result = run_cli("report", "--merge", *runs, "--format", "json", "-o", str(merged))
    assert result.code == 1, result.stdout + result.stderr  # the lossy replica differs from the two others
    report = _fleet(merged)
    assert [m["source"] for m in report["targets"]] == runs
    (finding,) = [f for f in report["findings"] if f["id"] == "replica-differs"]
    assert lossy.url.split("//")[1] in finding["title"]
    table = run_cli("report", str(merged))
    assert table.code == 1 and all(m["name"] in table.stdout for m in report["targets"])
    one = run_cli("report", str(merged), "--target", report["targets"][0]["name"])
    assert one.code == 0 and "FLEET" not in one.stdout
    for fmt in ("markdown", "junit", "html"):
        assert run_cli("report", str(merged), "--format", fmt).code == 1
    twice = run_cli("report", "--merge", runs[0], runs[0])
    assert twice.code == 2 and "in both" in twice.stderr
    several = run_cli("report", *runs)
    assert several.code == 2 and "--merge" in several.stderr


@pytest.mark.parametrize(("rows", "words"), [
    (['[[target]]', 'name = "x"', 'url = "http://127.0.0.1:9"', '[[target]]', 'name = "x"',
      'url = "http://127.0.0.1:10"'], "two targets"),
    (['[[target]]', 'url = "http://127.0.0.1:9"', 'api_key_env = "FLEET_TEST_UNSET_KEY"'], "FLEET_TEST_UNSET_KEY"),
    (['[[target]]', 'name = "n-{n}"', 'url = "http://127.0.0.1:{n}"', 'n = []'], "expands to nothing"),
    (['[[target]]', 'url = "http://127.0.0.1:9"', 'speed = "fast"'], "unknown key"),
])
def test_bad_targets_exit_2_before_any_request(tmp_path, rows, words):
    result = run_cli("probe", "--targets", _targets_file(tmp_path, rows))
    assert result.code == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    both = run_cli("probe", "--targets", _targets_file(tmp_path, rows[:2]), "--url", "http://127.0.0.1:9")
    assert both.code == 2 and "not both" in both.stderr


def test_ctrl_c_keeps_what_every_target_finished(standin, tmp_path):
    fast = standin("--dialect", "ddtree")
    slow = standin("--dialect", "ddtree", "--first-token-delay", "60")
    out = tmp_path / "f.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "ddtree_diag", "probe", "--url", fast.url, "--url", slow.url, *SMALL,
         "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 60
    # the fast target has answered and the slow one has its request in flight
    while time.monotonic() < deadline and not (fast.requests() and any(r.get("messages") for r in slow.requests())):
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    report = _fleet(out)
    assert report["interrupted"] is True
    members = _by_name(report)
    assert members[fast.url.split("//")[1]]["exit_code"] == 0
    stuck = members[slow.url.split("//")[1]]
    assert stuck["report"]["interrupted"] is True and stuck["exit_code"] == 130
    assert "Traceback" not in stderr


def test_fleet_only_flags_and_engine_baseline_are_refused(tmp_path):
    alone = run_cli("probe", "--url", "http://127.0.0.1:9", "--deadline", "5")
    assert alone.code == 2 and "--deadline is for fleets" in alone.stderr
    engine = run_cli("probe", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10", "--baseline", "engine")
    assert engine.code == 2 and "not for a fleet" in engine.stderr
    assert run_cli("probe", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10",
                   "--parallel", "0").code == 2
