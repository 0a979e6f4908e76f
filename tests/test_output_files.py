"""Output files as a CI job needs them: checked before the run, written atomically when regular,
in place when special (/dev/null, /dev/stdout, FIFOs), through symlinks, with the umask's mode,
and one clean line for a directory, a full disk or a missing folder. Reports are strict JSON."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading

import pytest

from ddtree_diag.errors import UsageError
from ddtree_diag.output.reportfile import check_writable, report_json, write_output
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    before = os.umask(0o022)
    os.umask(before)
    yield set_mask
    os.umask(before)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_mode_follows_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    path = tmp_path / "report.json"
    write_output(path, "{}\n")
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert not list(tmp_path.glob(".report.json.*")), "no temporary file left"


def test_existing_file_keeps_its_mode_and_is_replaced_atomically(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    path.chmod(0o640)
    inode = path.stat().st_ino
    write_output(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.stat().st_ino != inode, "a regular file is replaced by rename, not rewritten"


def test_symlink_is_followed_and_kept(tmp_path):
    target = tmp_path / "real" / "report.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_output(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made-by-write.json")
    write_output(dangling, "fresh")
    assert dangling.is_symlink() and (tmp_path / "made-by-write.json").read_text() == "fresh"


def test_special_files_are_written_in_place():
    write_output("/dev/null", "anything")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    check_writable("/dev/null", "--json")


def test_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    check_writable(str(fifo), "--json")  # never opens it (that would block until a reader came)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, '{"ok": true}\n')
    reader.join(timeout=10)
    assert received == [b'{"ok": true}\n'] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_missing_folders_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "report.json"
    check_writable(str(path), "--json")
    assert not path.parent.exists(), "the check creates nothing"
    write_output(path, "x")
    assert path.read_text() == "x"


@pytest.mark.parametrize("make, needle", [
    (lambda p: (p.mkdir(), p)[1], "it is a directory"),
    (lambda p: (p.write_text("file"), p / "report.json")[1], "Not a directory"),
    (lambda p: f"{p}/", "names a directory"),
])
def test_unwritable_targets_are_one_line(tmp_path, make, needle):
    path = make(tmp_path / "target")
    with pytest.raises(UsageError) as caught:
        check_writable(str(path), "--junit")
    assert needle in str(caught.value) and "--junit" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UsageError):
        write_output(path, "x")


def test_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="cannot write /dev/full: No space left on device"):
        write_output("/dev/full", "x" * 10_000)
    path = tmp_path / "report.json"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UsageError, match="No space left on device"):
        write_output(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_reports_are_strict_json_with_a_note_for_non_finite_numbers():
    result = ProbeResult(case=ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}]))
    result.output = "lone \ud800 surrogate"
    result.extras["server"] = {"tps": float("nan"), "big": [float("inf"), 1.5]}
    result.timings.e2e_s = float("inf")
    text = report_json(RunReport(results=[result]))

    def refuse(token):
        raise AssertionError(f"{token} in a report")

    data = json.loads(text, parse_constant=refuse)
    record = data["results"][0]
    assert record["extras"]["server"] == {"tps": None, "big": [None, 1.5]} and record["timings"]["e2e_s"] is None
    assert record["output"] == "lone \ud800 surrogate", "the same string, escaped as \\ud800 in the file"
    assert "\\ud800" in text
    text.encode("utf-8")  # writable as UTF-8
    assert any("non-finite numbers written as null" in n and "results[0].timings.e2e_s" in n for n in data["notes"])


def test_the_check_tries_for_real_and_leaves_nothing(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    check_writable(str(existing), "--json")
    check_writable(str(tmp_path / "new.json"), "--html")
    assert existing.read_text() == "keep me", "an existing file is not truncated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"], "no probe file is left"
    # os.access says yes to root in /proc; creating a file there fails for everyone
    for path, flag in (("/proc/nope.json", "--json"), ("/proc/version", "--junit")):
        with pytest.raises(UsageError) as caught:
            check_writable(path, flag)
        assert str(caught.value).startswith(f"cannot write {flag} {path}: ") and "\n" not in str(caught.value)


# -- the CLI ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_unwritable_output_fails_before_the_run(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # An unreachable URL: had the run started, the exit code would be 3, not 2.
    for flag in ("--json", "--junit", "--summary"):
        result = cli("probe", "--url", "http://127.0.0.1:9", "--model", "m", "--dialect", "openai",
                     flag, str(blocker / "out"))
        assert result.code == 2, result.stderr
        assert result.stderr.count("\n") == 1 and f"cannot write {flag}" in result.stderr
    result = cli("probe", "--url", "http://127.0.0.1:9", "--model", "m", "--dialect", "openai", "--json", str(tmp_path))
    assert result.code == 2 and "is a directory" in result.stderr


@pytest.mark.e2e
def test_proc_outputs_fail_before_anything_is_sent(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree")
    for flag in ("--json", "--html", "--junit", "--summary"):
        result = cli("probe", "--url", server.url, "--thinking", "off", flag, "/proc/nope.out", "--quiet")
        assert result.code == 2, result.stderr
        assert result.stderr.count("\n") == 1 and f"cannot write {flag} /proc/nope.out" in result.stderr
    assert server.requests() == [], "the check runs before the first request"


@pytest.mark.e2e
def test_special_and_full_outputs_after_a_run(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree")
    json_path = tmp_path / "run.json"
    result = cli("probe", "--url", server.url, "--thinking", "off", "--json", str(json_path), "--junit", "/dev/full",
                 "--summary", "/dev/null", "--quiet")
    assert result.code == 2, "a report that could not be written fails the job"
    assert result.stderr.strip() == "ddtree-diag: error: cannot write /dev/full: No space left on device"
    assert json.loads(json_path.read_text())["results"][0]["status"] == "ok", "the other outputs were written"
    result = cli("probe", "--url", server.url, "--thinking", "off", "--json", "/dev/stdout", "--no-color")
    assert result.code == 0
    start = result.stdout.index('{\n  "schema_version"')
    assert json.loads(result.stdout[start:])["results"][0]["status"] == "ok"


@pytest.mark.e2e
def test_report_and_diff_outputs_are_checked_first(cli, tmp_path):
    missing = tmp_path / "missing.json"  # would be "report not found" if the output were checked later
    result = cli("report", str(missing), "-o", str(tmp_path))
    assert result.code == 2 and "is a directory" in result.stderr
    result = cli("diff", str(missing), str(missing), "--json", str(tmp_path))
    assert result.code == 2 and "is a directory" in result.stderr

