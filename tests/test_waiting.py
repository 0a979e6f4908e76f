"""Long waits say what they are on stderr: the model load of ``probe --engine`` (a line when it
starts and one with the time when it ends, in a log or a pipe; nothing with --quiet), and the
``waiting`` helper itself (lines off a terminal, a spinner on one, silence when quiet)."""

from __future__ import annotations

import io
import re
import sys

import pytest

from ddtree_diag.output import waiting as waiting_module
from ddtree_diag.output.waiting import configured, waiting


class _Stream(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.unit
def test_waiting_writes_a_start_and_a_done_line_in_a_log(monkeypatch):
    stream = _Stream(terminal=False)
    monkeypatch.setattr(sys, "stderr", stream)
    with waiting("loading target model tiny"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ddtree-diag: loading target model tiny…"
    assert re.fullmatch(r"ddtree-diag: loading target model tiny: done in \d+\.\d s", lines[1])
    stream.truncate(0), stream.seek(0)
    with waiting("loading the scoring model"), waiting("loading target model tiny"):
        pass
    assert [line.split(":")[1] for line in stream.getvalue().splitlines()] == [" loading the scoring model…",
                                                                                " loading the scoring model"]


@pytest.mark.unit
def test_waiting_says_nothing_when_quiet_and_no_done_line_on_failure(monkeypatch):
    stream = _Stream(terminal=False)
    monkeypatch.setattr(sys, "stderr", stream)
    with configured(quiet=True), waiting("loading"):
        pass
    assert stream.getvalue() == "" and not waiting_module.is_quiet()  # restored after the command
    with pytest.raises(RuntimeError), waiting("loading"):
        raise RuntimeError("broken")
    assert stream.getvalue() == "ddtree-diag: loading…\n"  # the error line says the rest


@pytest.mark.unit
def test_waiting_on_a_terminal_is_a_spinner_then_one_done_line(monkeypatch):
    stream = _Stream(terminal=True)
    monkeypatch.setattr(sys, "stderr", stream)
    with waiting("building the cache"), waiting("inner step"):
        pass
    out = stream.getvalue()
    assert "✓ building the cache: done in" in out
    assert "ddtree-diag: building" not in out  # no log lines on a terminal


@pytest.mark.engine
def test_probe_engine_says_the_model_is_loading(cli, tmp_path):
    from tests.support import engine_fixtures as fx

    target, draft = fx.tiny_models(tmp_path)
    args = ("probe", "--engine", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dtype",
            "fp32", "--thinking", "off", "--budget", "4", "--max-tokens", "4")
    shown = cli(*args, timeout=600)
    assert shown.code in (0, 1), shown.stderr  # random weights: garbage may be flagged
    lines = shown.stderr.splitlines()
    loading = f"ddtree-diag: loading target model {target.name} and draft {draft.name}"
    assert lines[0] == loading + "…", shown.stderr  # before anything else, the first thing on stderr
    assert any(re.fullmatch(re.escape(loading) + r": done in \d+\.\d s", line) for line in lines), shown.stderr
    # --quiet reaching the engine's load is checked on another engine run (tests/test_likelihood.py)


@pytest.mark.unit
def test_building_the_embedded_cache_says_so_once(monkeypatch, tmp_path):
    from ddtree_diag.engine import embedded

    gguf = tmp_path / embedded.GGUF_FILENAME
    gguf.write_bytes(b"GGUF")
    built = []

    def fake_build(gguf_path, root, target):  # the real one dequantises for ~40 s
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")
        (target / embedded.STAMP_FILE).write_text(__import__("json").dumps(embedded._expected_stamp(gguf_path)))
        built.append(target)

    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    monkeypatch.setattr(embedded, "_build_into_place", fake_build)
    stream = _Stream(terminal=False)
    monkeypatch.setattr(sys, "stderr", stream)
    target = embedded.ensure_target_dir(tmp_path / "cache")
    assert built == [target]
    first = stream.getvalue().splitlines()
    assert first[0].startswith("ddtree-diag: building the embedded model cache (first run, ~40 s on 2 cores)")
    assert first[1].endswith(" s") and "done in" in first[1]
    assert embedded.ensure_target_dir(tmp_path / "cache") == target and len(built) == 1
    assert stream.getvalue().splitlines() == first  # a current cache loads silently
