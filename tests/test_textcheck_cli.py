"""`text-check`: files, stdin, JSON and JSONL, exit codes — through the function the typer command
wraps and through the module entry point."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_diag.commands.textcheck import run_text_check
from ddtree_diag.errors import UsageError

ROOT = Path(__file__).parent.parent
STORY = "Thinking to the 1. 1. 题目:\nuser:\n# user: 1.\n# 1. 1. 1. 年 1 1. 三角形\n1."


def check(tmp_path, text: str, *args, **kwargs) -> tuple[int, str]:
    path = tmp_path / "answer.txt"
    path.write_text(text, encoding="utf-8")
    out = io.StringIO()
    code = run_text_check(str(path), *args, out=out, **kwargs)
    return code, out.getvalue()


def test_clean_file_exits_0_and_says_clean(tmp_path):
    code, out = check(tmp_path, "Hello! Nice to meet you.\n", "Say hello.", False, False, "stop")
    assert code == 0
    assert "✓ clean" in out


def test_garbage_file_exits_1_and_names_the_reasons(tmp_path):
    code, out = check(tmp_path, STORY + "\n", "Say hello in one short sentence.", False, False, "length")
    assert code == 1
    assert "✗ garbage" in out
    for reason in ("degenerate_enumeration", "script_mix", "role_leak", "truncated"):
        assert reason in out


def test_json_output_is_the_verdict_dict(tmp_path):
    code, out = check(tmp_path, "Hello,", None, True, False, "stop")
    data = json.loads(out)
    assert code == 1
    assert data["garbage"] is True
    assert data["reasons"][0]["code"] == "premature_stop"
    assert data["reasons"][0]["evidence"] == "Hello,"


def test_one_trailing_newline_is_not_part_of_the_answer(tmp_path):
    # "Hello," + newline from `echo` must still end on a comma.
    code, out = check(tmp_path, "Hello,\n", None, True, False, "stop")
    assert code == 1 and json.loads(out)["reasons"][0]["code"] == "premature_stop"


def test_invalid_utf8_is_reported_as_replacement_characters(tmp_path):
    path = tmp_path / "bytes.txt"
    path.write_bytes(b"Hello wor" + b"\xe4\xb8 there")
    out = io.StringIO()
    assert run_text_check(str(path), None, True, False, None, out=out) == 1
    assert json.loads(out.getvalue())["reasons"][0]["code"] == "replacement_char"


def test_jsonl_gives_one_verdict_per_line_in_order(tmp_path):
    rows = [
        {"id": "a", "text": "Hello!", "prompt": "Say hello.", "finish_reason": "stop"},
        {"id": "b", "text": STORY, "prompt": "Say hello in one short sentence.", "finish_reason": "length"},
        {"text": "The cat sat on the mat. It was warm.", "finish_reason": "length"},
        {"output": "你好！", "prompt": "打个招呼。"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    out = io.StringIO()
    code = run_text_check(str(path), None, False, True, None, out=out)
    verdicts = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 1
    assert [v["garbage"] for v in verdicts] == [False, True, False, False]
    assert [v.get("id") for v in verdicts] == ["a", "b", None, None]
    assert verdicts[2]["truncated"] is True


def test_jsonl_verdicts_carry_the_input_line_number(tmp_path):
    path = tmp_path / "in.jsonl"
    # a blank line in the middle still counts: the numbers are the file's own line numbers
    path.write_text(json.dumps({"text": "Hello!"}) + "\n\n" + json.dumps({"text": "the the the the the the"}) + "\n")
    out = io.StringIO()
    assert run_text_check(str(path), None, False, True, None, out=out) == 1
    verdicts = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(v["line"], v["garbage"]) for v in verdicts] == [(1, False), (3, True)]


def test_jsonl_all_clean_exits_0_and_flags_are_defaults(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": "Hello,"}) + "\n", encoding="utf-8")
    # No finish_reason in the line: the --finish-reason default applies.
    assert run_text_check(str(path), None, False, True, None, out=io.StringIO()) == 0
    assert run_text_check(str(path), None, False, True, "stop", out=io.StringIO()) == 1


def test_jsonl_text_with_line_separator_characters_stays_one_record(tmp_path):
    path = tmp_path / "in.jsonl"
    text = "Caf\x85 and \u2028 line separator"
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    out = io.StringIO()
    run_text_check(str(path), None, False, True, None, out=out)
    assert len(out.getvalue().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "in.jsonl:1: not valid JSON"),
        ('{"text": "ok"}\n[1, 2]\n', "in.jsonl:2: expected a JSON object"),
        ('{"prompt": "x"}\n', "in.jsonl:1: needs a string 'text' field"),
        ('{"text": "ok", "max_tokens": "48"}\n', "in.jsonl:1: 'max_tokens' must be int"),
    ],
)
def test_a_bad_jsonl_line_is_named_with_its_number_and_the_good_lines_are_judged(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    path.write_text(content, encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    code = run_text_check(str(path), None, False, True, None, out=out, err=err)
    assert code == 2  # nothing garbage, but not everything could be judged
    errors = err.getvalue().splitlines()
    assert errors[0].startswith(f"ddtree-diag: error: {tmp_path / message}"), errors
    assert errors[-1] == f"ddtree-diag: 1 of {content.count(chr(10))} line(s) in {path} could not be judged"
    good = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [g["line"] for g in good] == ([1] if content.startswith('{"text": "ok"}') else [])
    assert all(not g["garbage"] for g in good)


def test_jsonl_with_bad_lines_judges_the_rest_and_exits_by_what_it_found(tmp_path):
    lines = [json.dumps({"text": "Fine, thanks."}), "{oops", json.dumps({"text": "<|im_start|>assistant\nHi"}),
             "", json.dumps({"text": 7}), json.dumps({"text": "All good here.", "id": "c"})]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    code = run_text_check(str(path), None, False, True, None, out=out, err=err)
    assert code == 1  # a judged line is garbage: that is the finding, bad lines or not
    verdicts = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(v["line"], v["garbage"]) for v in verdicts] == [(1, False), (3, True), (6, False)]
    assert verdicts[2]["id"] == "c"
    errors = err.getvalue().splitlines()
    assert errors[0].startswith(f"ddtree-diag: error: {path}:2: not valid JSON (")
    assert errors[1] == f"ddtree-diag: error: {path}:5: needs a string 'text' field"
    assert errors[2] == f"ddtree-diag: 2 of 5 line(s) in {path} could not be judged"
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join([lines[0], lines[1], lines[5]]) + "\n", encoding="utf-8")
    assert run_text_check(str(clean), None, False, True, None, out=io.StringIO(), err=io.StringIO()) == 2


def test_plain_verdict_uses_200_columns_when_piped_and_excerpts_start_at_words(tmp_path):
    from ddtree_diag.commands.textcheck import excerpt

    text = "Here is a long answer. " + "the the the the the the the the the the " + "x" * 150
    code, out = check(tmp_path, text, "Say something.", False, False, "stop")
    assert code == 1
    assert max(len(line) for line in out.splitlines()) > 80  # not wrapped at rich's 80-column default
    assert max(len(line) for line in out.splitlines()) <= 200
    words = "The quick brown fox jumps over the lazy dog"
    assert excerpt(words, (12, 30), words[12:30]) == "…brown fox jumps over…"
    assert excerpt(words, (5, 20), words[5:20]) == "…quick brown fox…"
    assert excerpt(words, (0, 9), words[0:9]) == "The quick…"
    assert excerpt(words, (35, 43), words[35:43]) == "…lazy dog"
    assert excerpt("", None, "quoted") == "quoted"


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        run_text_check(str(tmp_path / "nope.txt"), None, False, False, None)


@pytest.mark.e2e
def test_cli_turns_errors_into_one_line_and_exit_2(tmp_path):
    result = _module(str(tmp_path / "nope.txt"), stdin="")
    assert result.returncode == 2
    err = result.stderr.decode()
    assert "cannot read" in err and err.count("\n") == 1


def _module(*args: str, stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "ddtree_diag", "text-check", *args],
        input=stdin.encode(),
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.e2e
def test_module_entry_point_reads_stdin():
    bad = _module("-", "--finish-reason", "stop", "--json", stdin="Hello,\n")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["reasons"][0]["code"] == "premature_stop"
    good = _module("--prompt", "Say hello in one short sentence.", stdin="Hello there!\n")
    assert good.returncode == 0
    assert "✓ clean" in good.stdout.decode()


@pytest.mark.e2e
def test_module_entry_point_jsonl_and_usage_errors():
    lines = json.dumps({"text": "<|im_start|>assistant\nHi"}) + "\n" + json.dumps({"text": "Fine."}) + "\n"
    proc = _module("--jsonl", stdin=lines)
    assert proc.returncode == 1
    assert [json.loads(x)["garbage"] for x in proc.stdout.decode().splitlines()] == [True, False]
    bad = _module("--jsonl", stdin="{oops\n" + json.dumps({"text": "Fine."}) + "\n")
    assert bad.returncode == 2 and [json.loads(x)["line"] for x in bad.stdout.decode().splitlines()] == [2]
    assert b"Traceback" not in bad.stderr and bad.stderr.decode().startswith("ddtree-diag: error: -:1:")
    unknown = _module("--no-such-flag", stdin="")
    assert unknown.returncode == 2


def test_greedy_without_a_model_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="--greedy needs --score-with"):
        check(tmp_path, "Hello!", "Say hello.", False, False, "stop", greedy=True)


@pytest.mark.real_model
def test_score_with_the_embedded_model_from_the_command_line(tmp_path, cli):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    clean = tmp_path / "clean.txt"
    clean.write_text("The capital of Australia is Canberra.\n", encoding="utf-8")
    salad = tmp_path / "salad.txt"
    salad.write_text("The cap italof Aus tral iaisCan ber raa ndth ebig gestc ityis Syd neyw hichha sthe\n")
    common = ("--prompt", "What is the capital of Australia?", "--finish-reason", "stop", "--json",
              "--score-with", "embedded")
    good = cli("text-check", str(clean), *common, timeout=600)
    assert good.code == 0, good.stderr
    scores = good.json()["likelihood"]  # a clean answer shows its scores and the thresholds too
    assert scores["mean_surprisal"] < scores["thresholds"]["mean_soft"] and scores["model"]
    bad = cli("text-check", str(salad), *common, timeout=600)
    assert bad.code == 1, bad.stderr
    reasons = {r["code"]: r for r in bad.json()["reasons"]}
    assert "low_likelihood" in reasons and "nats/token" in reasons["low_likelihood"]["detail"]


def test_plain_verdict_prints_the_likelihood_scores_with_their_thresholds():
    """A clean scored answer still shows its figures (the model run itself is tested above)."""
    import io

    from ddtree_diag.checks.likelihood import THRESHOLDS
    from ddtree_diag.commands.textcheck import _print_verdict
    from ddtree_diag.records import Verdict

    scores = {"model": "SmolLM2", "tokens": 40, "mean_surprisal": 2.03, "worst_span_surprisal": 3.5,
              "greedy_checked": True, "not_greedy_at_token": None, "thresholds": THRESHOLDS}
    out = io.StringIO()
    _print_verdict(Verdict(garbage=False, score=0.0, likelihood=scores), out, "text")
    shown = " ".join(out.getvalue().split())
    assert "SmolLM2: 2.03 nats/token over 40 tokens" in shown
    assert f"low_likelihood at >= {THRESHOLDS['mean_soft']} soft" in shown and "worst 16-token stretch 3.50" in shown
    assert "every token the greedy choice" in shown
