"""`ddtree-diag text-check`: run the garbage-text detector on text from a file or stdin.

    ddtree-diag text-check answer.txt --prompt "Say hello in one short sentence."
    echo 'Hello,' | ddtree-diag text-check - --finish-reason stop --json
    ddtree-diag text-check outputs.jsonl --jsonl      # one {"text", "prompt", "finish_reason"} per line

Plain mode reads the whole input as one answer (one trailing newline dropped) and prints the
verdict with its reasons; ``--json`` prints ``Verdict.to_dict()`` instead. ``--jsonl`` reads one
JSON object per line (``text`` or ``output``; optional ``prompt``, ``finish_reason``, ``thinking``,
``reasoning``, ``completion_tokens``, ``max_tokens``, ``id``) and writes one verdict per line, in
order, each with the input's ``line`` number (1-based) and its ``id`` when it has one. Exit code:
0 all clean, 1 any garbage, 2 bad input or usage.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import typer

from ddtree_diag.commands.options import DEBUG
from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
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
                                        greedy=greedy))  # fmt: skip


_JSONL_FIELDS = ("prompt", "finish_reason", "completion_tokens", "max_tokens", "thinking", "reasoning")


def run_text_check(
    path: str | None,
    prompt: str | None,
    as_json: bool,
    jsonl: bool,
    finish_reason: str | None,
    *,
    out: TextIO | None = None,
    score_with: str | None = None,
    greedy: bool = False,
) -> int:
    """Check the text in ``path`` ("-" or None = stdin) and print the verdict(s).

    Returns 0 when everything is clean, 1 when any input is garbage. Raises UsageError (exit 2)
    for an unreadable file or a bad JSONL line, or --greedy without --score-with.
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
        return _check_jsonl(raw, prompt, finish_reason, out, source=path or "-", scoring=scoring)
    text = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
    verdict = assess(text, prompt=prompt, finish_reason=finish_reason, **scoring)
    if as_json:
        out.write(_dumps(verdict.to_dict()) + "\n")
    else:
        _print_verdict(verdict, out)
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


def _check_jsonl(
    raw: str, prompt: str | None, finish_reason: str | None, out: TextIO, source: str, scoring: dict[str, Any]
) -> int:
    # Parse everything first, so a bad line fails before any verdict is printed.
    # Split on "\n" only: str.splitlines would also split on U+0085/U+2028 inside a JSON string.
    rows: list[tuple[int, dict[str, Any], str, dict[str, Any]]] = []
    for lineno, line in enumerate(raw.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(row).__name__}")
        text = row.get("text", row.get("output"))
        if not isinstance(text, str):
            raise UsageError(f"{where}: needs a string 'text' field")
        kwargs = {key: row.get(key) for key in _JSONL_FIELDS}
        for key, types in _FIELD_TYPES.items():
            value = kwargs[key]
            if value is not None and (
                not isinstance(value, types) or (types == (int,) and isinstance(value, bool))
            ):
                raise UsageError(f"{where}: '{key}' must be {types[0].__name__}, got {type(value).__name__}")
        if kwargs["prompt"] is None:
            kwargs["prompt"] = prompt
        if kwargs["finish_reason"] is None:
            kwargs["finish_reason"] = finish_reason
        rows.append((lineno, row, text, kwargs))
    from ddtree_diag.checks.quality import assess

    any_garbage = False
    for lineno, row, text, kwargs in rows:
        verdict = assess(text, **kwargs, **scoring)
        # The input line (1-based, blank lines counted) ties a verdict to its input line; the
        # input's own id, when it has one, comes along too.
        record = {"line": lineno, **({"id": row["id"]} if "id" in row else {}), **verdict.to_dict()}
        out.write(_dumps(record) + "\n")
        any_garbage = any_garbage or verdict.garbage
    return EXIT_CHECK_FAILED if any_garbage else EXIT_OK


def _print_verdict(verdict: Verdict, out: TextIO) -> None:
    from rich.console import Console  # lazy: keeps `import ddtree_diag.commands.textcheck` light
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=out, highlight=False, soft_wrap=True)
    if verdict.garbage:
        console.print(f"[bold red]✗ garbage[/] (score {verdict.score:.2f})")
    else:
        trunc = " [yellow](truncated)[/]" if verdict.truncated else ""
        console.print(f"[bold green]✓ clean[/] (score {verdict.score:.2f}){trunc}")
    if not verdict.reasons:
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("reason")
    table.add_column("severity")
    table.add_column("detail", overflow="fold")
    table.add_column("evidence", overflow="fold")
    for reason in verdict.reasons:
        colour = {"hard": "red", "soft": "yellow"}.get(reason.severity, "dim")
        evidence = repr(reason.evidence) if reason.evidence else ""
        table.add_row(reason.code, f"[{colour}]{reason.severity}[/]", escape(reason.detail), escape(evidence))
    console.print(table)
