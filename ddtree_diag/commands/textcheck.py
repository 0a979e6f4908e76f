"""`ddtree-diag text-check`: run the garbage-text detector on text from a file or stdin.

    ddtree-diag text-check answer.txt --prompt "Say hello in one short sentence."
    echo 'Hello,' | ddtree-diag text-check - --finish-reason stop --json
    ddtree-diag text-check outputs.jsonl --jsonl      # one {"text", "prompt", "finish_reason"} per line

Plain mode reads the whole input as one answer (one trailing newline dropped) and prints the
verdict with its reasons; ``--json`` prints ``Verdict.to_dict()`` instead. ``--jsonl`` reads one
JSON object per line (``text`` or ``output``; optional ``prompt``, ``finish_reason``, ``thinking``,
``reasoning``, ``completion_tokens``, ``max_tokens``, ``id``) and writes one verdict per line, in
order, each with the input's ``line`` number (1-based) and its ``id`` when it has one. A line that
cannot be judged (not JSON, not an object, no text, a field of the wrong type) is named on stderr
with its number and why, and the other lines are judged all the same. Exit code: 0 every input
judged clean, 1 any garbage, 2 no garbage but a line could not be judged (or bad usage, an
unreadable file).

The plain verdict is laid out like ``probe``'s table: the terminal's width, else $COLUMNS, else
200 columns; evidence excerpts start and end at word boundaries, with "…" where text was cut.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

import typer

from ddtree_diag.commands.options import DEBUG
from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, UsageError

if TYPE_CHECKING:
    from ddtree_diag.records import Verdict


def register(app: typer.Typer) -> None:
    @app.command("text-check")
    def text_check(
        file: str = typer.Argument("-", help="File to check, or - for stdin."),
        prompt: str | None = typer.Option(
            None, "--prompt", help="The prompt the text answers (enables script checks)."
        ),
        finish_reason: str | None = typer.Option(None, "--finish-reason", help="The server's finish_reason."),
        as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
        jsonl: bool = typer.Option(False, "--jsonl", help="Input is JSON lines {text, prompt, finish_reason, ...}."),
        score_with: str | None = typer.Option(
            None, "--score-with",
            help="Also teacher-force the text through a model (embedded, or an HF dir / .gguf path; needs the "
            "engine extra): mean surprisal, worst span (low_likelihood).",
        ),
        greedy: bool = typer.Option(
            False, "--greedy",
            help="With --score-with: the text is that model's own T=0 answer, so every token must be its "
            "argmax (not_greedy names the first that is not).",
        ),
        debug: bool = DEBUG,
    ) -> None:
        """Flag text no healthy model would write (loops, leaks, script switches...): exit 1 if garbage."""
        raise typer.Exit(run_text_check(file, prompt, as_json, jsonl, finish_reason, score_with=score_with,
                                        greedy=greedy))


_JSONL_FIELDS = ("prompt", "finish_reason", "completion_tokens", "max_tokens", "thinking", "reasoning")


def run_text_check(
    path: str | None,
    prompt: str | None,
    as_json: bool,
    jsonl: bool,
    finish_reason: str | None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    score_with: str | None = None,
    greedy: bool = False,
) -> int:
    """Check the text in ``path`` ("-" or None = stdin) and print the verdict(s).

    Returns 0 when everything is clean, 1 when any input is garbage, 2 when nothing was garbage
    but a JSONL line could not be judged (each such line is named on ``err``). Raises UsageError
    (exit 2) for an unreadable file, or --greedy without --score-with.
    """
    from ddtree_diag.checks.quality import assess

    if greedy and not score_with:
        raise UsageError("--greedy needs --score-with MODEL (the model whose T=0 answer the text is)")
    out = out or sys.stdout
    raw = _read(path)
    scoring: dict[str, Any] = {}
    if score_with:
        from ddtree_diag.checks.likelihood import scorer_for

        scoring = {"scorer": scorer_for(score_with, own_weights=greedy), "temperature": 0.0 if greedy else None}
    if jsonl:
        return _check_jsonl(raw, prompt, finish_reason, out, err or sys.stderr, source=path or "-", scoring=scoring)
    text = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
    verdict = assess(text, prompt=prompt, finish_reason=finish_reason, **scoring)
    if as_json:
        out.write(_dumps(verdict.to_dict()) + "\n")
    else:
        _print_verdict(verdict, out, text)
    return EXIT_CHECK_FAILED if verdict.garbage else EXIT_OK


def _dumps(data: dict[str, Any]) -> str:
    """One JSON line, readable (no \\u escapes for CJK) but with the characters that other tools
    treat as line breaks (U+0085, U+2028, U+2029) escaped, so one verdict stays one line."""
    text = json.dumps(data, ensure_ascii=False)
    return text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _read(path: str | None) -> str:
    if path in (None, "-"):
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    else:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    # Invalid UTF-8 becomes U+FFFD, which the detector then reports: broken bytes are a finding.
    return data.decode("utf-8", errors="replace")


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "prompt": (str,),
    "finish_reason": (str,),
    "reasoning": (str,),
    "thinking": (bool,),
    "completion_tokens": (int,),
    "max_tokens": (int,),
}


def _parse_line(line: str, prompt: str | None, finish_reason: str | None) -> tuple[dict, str, dict[str, Any]]:
    """(row, text, assess keyword arguments) of one JSONL line; ValueError says why it cannot be
    judged, in one line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    text = row.get("text", row.get("output"))
    if not isinstance(text, str):
        raise ValueError("needs a string 'text' field")
    kwargs = {key: row.get(key) for key in _JSONL_FIELDS}
    for key, types in _FIELD_TYPES.items():
        value = kwargs[key]
        if value is not None and (not isinstance(value, types) or (types == (int,) and isinstance(value, bool))):
            raise ValueError(f"'{key}' must be {types[0].__name__}, got {type(value).__name__}")
    if kwargs["prompt"] is None:
        kwargs["prompt"] = prompt
    if kwargs["finish_reason"] is None:
        kwargs["finish_reason"] = finish_reason
    return row, text, kwargs


def _check_jsonl(raw: str, prompt: str | None, finish_reason: str | None, out: TextIO, err: TextIO, source: str,
                 scoring: dict[str, Any]) -> int:
    """Judge every line that can be judged; name each one that cannot on ``err``."""
    from ddtree_diag.checks.quality import assess

    any_garbage = False
    judged = bad = 0
    # Split on "\n" only: str.splitlines would also split on U+0085/U+2028 inside a JSON string.
    for lineno, line in enumerate(raw.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row, text, kwargs = _parse_line(line, prompt, finish_reason)
        except ValueError as exc:
            bad += 1
            err.write(f"ddtree-diag: error: {source}:{lineno}: {exc}\n")
            err.flush()
            continue
        verdict = assess(text, **kwargs, **scoring)
        # The input line (1-based, blank lines counted) ties a verdict to its input line; the
        # input's own id, when it has one, comes along too.
        record = {"line": lineno, **({"id": row["id"]} if "id" in row else {}), **verdict.to_dict()}
        out.write(_dumps(record) + "\n")
        judged += 1
        any_garbage = any_garbage or verdict.garbage
    if bad:
        err.write(f"ddtree-diag: {bad} of {bad + judged} line(s) in {source} could not be judged\n")
    if any_garbage:
        return EXIT_CHECK_FAILED
    return EXIT_USAGE if bad else EXIT_OK


EXCERPT_CHARS = 60
_WORD_REACH = 20  # how far an excerpt may move to start or end at a word boundary


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


def excerpt(text: str, span: tuple[int, int] | None, evidence: str) -> str:
    """The evidence as an excerpt of ``text`` that starts and ends at word boundaries (moving back
    to the start of a word cut in two, or on to the next one when that word is long), with "…"
    where the text goes on. Evidence not found at its span is shown as it is."""
    if not evidence:
        return ""
    start = span[0] if span is not None and text[span[0] : span[0] + len(evidence)] == evidence else text.find(evidence)
    if start < 0:
        return evidence
    end = min(len(text), start + max(len(evidence), 1), start + EXCERPT_CHARS)
    if 0 < start < len(text) and _is_word(text[start - 1]) and _is_word(text[start]):  # cut mid-word
        back = start
        while back > 0 and _is_word(text[back - 1]) and start - back < _WORD_REACH:
            back -= 1
        if back == 0 or not _is_word(text[back - 1]):
            start = back
        else:  # a very long word: start at the next one instead
            while start < end and _is_word(text[start]):
                start += 1
    if 0 < end < len(text) and _is_word(text[end - 1]) and _is_word(text[end]):
        forward = end
        while forward < len(text) and _is_word(text[forward]) and forward - end < _WORD_REACH:
            forward += 1
        end = forward
    shown = text[start:end].strip() or evidence
    return ("…" if start > 0 else "") + shown + ("…" if end < len(text) else "")


def _print_verdict(verdict: Verdict, out: TextIO, text: str = "") -> None:
    from rich.markup import escape  # lazy: keeps `import ddtree_diag.commands.textcheck` light
    from rich.table import Table

    from ddtree_diag.output.console import make_console

    console = make_console(out)  # the terminal's width; in a pipe or a log $COLUMNS, else 200, as probe
    if verdict.garbage:
        console.print(f"[bold red]✗ garbage[/] (score {verdict.score:.2f})")
    else:
        trunc = " [yellow](truncated)[/]" if verdict.truncated else ""
        console.print(f"[bold green]✓ clean[/] (score {verdict.score:.2f}){trunc}")
    if verdict.likelihood is not None:
        from ddtree_diag.checks.likelihood import describe_scores

        console.print(f"scores: {escape(describe_scores(verdict.likelihood))}")
    if not verdict.reasons:
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("reason")
    table.add_column("severity")
    table.add_column("detail", overflow="fold")
    table.add_column("evidence", overflow="fold")
    for reason in verdict.reasons:
        colour = {"hard": "red", "soft": "yellow"}.get(reason.severity, "dim")
        evidence = repr(excerpt(text, reason.span, reason.evidence)) if reason.evidence else ""
        table.add_row(reason.code, f"[{colour}]{reason.severity}[/]", escape(reason.detail), escape(evidence))
    console.print(table)
