"""Matrix TOML parsing, flag overrides and case expansion."""

from __future__ import annotations

import re

import pytest

from ddtree_diag.errors import UsageError
from ddtree_diag.matrix import Matrix, MatrixRequest, apply_overrides, load_matrix, matrix_from_dict, resolve_matrix


def test_smoke_matrix_is_the_story_probe():
    cases = resolve_matrix(MatrixRequest(matrix="smoke")).cases()
    assert [(c.enable_thinking, c.tree_budget) for c in cases] == [
        (False, 16), (False, 64), (True, 16), (True, 64)]
    assert {c.max_tokens for c in cases} == {48} and {c.temperature for c in cases} == {0.0}
    assert cases[0].messages == [{"role": "user", "content": "Say hello in one short sentence."}]


def test_default_without_matrix_or_prompt_is_smoke():
    assert len(resolve_matrix(MatrixRequest()).cases()) == 4


def test_order_is_stable_prompt_thinking_budget_temperature_max_repeat():
    matrix = matrix_from_dict({
        "defaults": {"repeat": 2},
        "axes": {"enable_thinking": [False, True], "tree_budget": [8, "default"], "temperature": [0, 0.7]},
        "prompts": {"a": "first", "b": {"messages": [{"role": "user", "content": "second"}]}},
    })
    cases = matrix.cases()
    assert len(cases) == 2 * 2 * 2 * 2 * 2
    keys = [(c.prompt_id, c.enable_thinking, c.tree_budget is None, c.temperature, c.repeat) for c in cases]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1], k[2], k[3], k[4]))
    assert len({c.case_id for c in cases}) == len(cases)


def test_system_prompt_and_extra_fields():
    matrix = matrix_from_dict({"defaults": {"system": "Be brief."}, "prompts": {"p": "hi"},
                               "extra": {"seed": 1}})
    case = matrix.cases()[0]
    assert case.messages[0] == {"role": "system", "content": "Be brief."}
    assert case.extra == {"seed": 1} and case.prompt_text == "hi"


@pytest.mark.parametrize(
    "data, needle",
    [({"axis": {}}, "unknown key 'axis'"),
     ({"axes": {"tree_budget": []}}, "non-empty list"),
     ({"axes": {"tree_budget": [-1]}}, "integer >= 0"),
     ({"axes": {"temperature": ["hot"]}}, "temperature"),
     ({"axes": {"max_tokens": [0]}}, "integer >= 1"),
     ({"prompts": {"p": {"txt": "x"}}}, "prompts.p.'txt'"),
     ({"prompts": {"p": {"messages": [{"role": "bot", "content": "x"}]}}}, "role"),
     ({"defaults": {"repeat": 0}}, "defaults.repeat"),
     ({"defaults": {"max_tokens": 0}}, "m.toml: defaults.max_tokens"),
     ({"defaults": {"temperature": "hot"}}, "m.toml: defaults.temperature"),
     ({"defaults": {"tree_budget": -1}, "axes": {"max_tokens": [8]}}, "m.toml: defaults.tree_budget"),
     ({"defaults": {"max_tokens": 8}, "axes": {"max_tokens": [0]}}, "m.toml: axes.max_tokens")],
)
def test_bad_matrices_name_the_key(data, needle):
    with pytest.raises(UsageError) as info:
        matrix_from_dict(data, source="m.toml")
    assert needle in str(info.value) and "m.toml" in str(info.value)
    # a key is named in the section it is really in
    wrong = "axes." if needle.startswith("m.toml: defaults.") else "defaults." if "axes." in needle else None
    assert wrong is None or wrong not in str(info.value)


def test_overrides_replace_axes(tmp_path):
    prompt_file = tmp_path / "ask.txt"
    prompt_file.write_text("What is 2+2?\n")
    messages = tmp_path / "conv.json"
    messages.write_text('[{"role": "user", "content": "Hi"}]')
    matrix = apply_overrides(
        Matrix(prompts={"named": [{"role": "user", "content": "n"}]}),
        prompts=["named", f"@{prompt_file}", f"@{messages}", "literal text"],
        thinking="on", budget="0,default", temperature="0.5", max_tokens="16,32", repeat=1,
    )
    assert list(matrix.prompts) == ["named", "ask", "conv", "prompt4"]
    assert matrix.prompts["ask"].messages[0]["content"] == "What is 2+2?"
    assert matrix.enable_thinking == [True] and matrix.tree_budget == [0, None]
    assert matrix.temperature == [0.5] and matrix.max_tokens == [16, 32]


def test_missing_prompt_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read file"):
        apply_overrides(Matrix(), prompts=[f"@{tmp_path / 'none.txt'}"])


def test_a_prompt_file_that_is_not_utf8_is_a_usage_error(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(UsageError, match="not UTF-8 text"):
        apply_overrides(Matrix(), prompts=[f"@{latin}"])


def test_two_prompt_files_of_one_name_both_run(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "q.txt").write_text("First?")
    (tmp_path / "b" / "q.txt").write_text("Second?")
    matrix = apply_overrides(Matrix(), prompts=[f"@{tmp_path / 'a' / 'q.txt'}", f"@{tmp_path / 'b' / 'q.txt'}"])
    assert {key: spec.messages[-1]["content"] for key, spec in matrix.prompts.items()} == {
        "q": "First?", "q-2": "Second?"}


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_temperature_that_is_not_finite_and_positive_is_a_usage_error(value):
    with pytest.raises(UsageError, match="temperature must be a finite number >= 0"):
        apply_overrides(Matrix(), temperature=value)
    with pytest.raises(UsageError, match="temperature must be a finite number >= 0"):
        matrix_from_dict({"prompts": {"a": "x"}, "axes": {"temperature": [float(value)]}})


@pytest.mark.parametrize(("key", "instead"), [("stream", "--no-stream"), ("max_tokens", "max_tokens axis"),
                                              ("model", "--model"), ("messages", "[prompts]")])
def test_extra_cannot_redefine_what_a_case_is(key, instead):
    with pytest.raises(UsageError, match=rf"\[extra\] cannot set '{key}'.*{re.escape(instead)}"):
        matrix_from_dict({"prompts": {"a": "x"}, "extra": {key: 1}})
    assert matrix_from_dict({"prompts": {"a": "x"}, "extra": {"top_p": 0.9}}).extra == {"top_p": 0.9}


def test_a_probe_says_when_the_gate_or_baseline_table_it_ignores_is_broken(tmp_path):
    from ddtree_diag.backends import HttpTarget
    from ddtree_diag.orchestrator import RunPlan, prepare

    for table in ('[gate]\nmin_acceptance = "high"\n', '[baseline]\nmode = "psychic"\n'):
        path = tmp_path / "m.toml"
        path.write_text('[prompts]\na = "hi"\n' + table)
        with pytest.raises(UsageError):
            prepare(RunPlan(target=HttpTarget(url="http://127.0.0.1:1"), matrix=MatrixRequest(matrix=str(path))))


def test_load_matrix_reports_toml_line(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('[prompts]\nhello = "unterminated\n')
    with pytest.raises(UsageError, match=r"invalid TOML.*line 2"):
        load_matrix(path)


def test_every_example_and_builtin_matrix_parses():
    """The example matrices in probes/ and the built-ins are valid: their cases expand, their
    [gate] and [baseline] tables parse."""
    from ddtree_diag.checks.gate import parse_gate
    from ddtree_diag.checks.lossless import parse_baseline
    from ddtree_diag.matrix import builtin_matrix, builtin_names, load_matrix
    from tests.support.processes import ROOT

    examples = sorted((ROOT / "probes").glob("*.toml"))
    assert len(examples) >= 3
    matrices = [load_matrix(path) for path in examples] + [builtin_matrix(name) for name in builtin_names()]
    for matrix in matrices:
        assert matrix.cases(), matrix.source
        parse_gate(matrix.gate, matrix.source)
        parse_baseline(matrix.baseline or None, matrix.source)
    assert {"smoke", "gate"} <= set(builtin_names())


@pytest.mark.parametrize("spec", ["nope", "nope.toml", "missing/dir/m.toml", "."])
def test_a_matrix_that_is_not_there_lists_the_built_ins(spec):
    from ddtree_diag.matrix import MatrixRequest, builtin_names, resolve_matrix

    with pytest.raises(UsageError) as caught:
        resolve_matrix(MatrixRequest(matrix=spec))
    assert f"built-in matrices: {', '.join(builtin_names())}" in str(caught.value)


def test_help_shows_defaults_builtins_and_every_dialect():
    """--help shows what an omitted --budget/--max-tokens/--matrix means and every --dialect."""
    from typer.testing import CliRunner

    from ddtree_diag.backends.dialects import DIALECTS
    from ddtree_diag.cli import app
    from ddtree_diag.commands.run import BUILTINS
    from ddtree_diag.matrix import builtin_matrix, builtin_names

    assert set(BUILTINS.split(", ")) == set(builtin_names())  # the help names every built-in
    smoke = builtin_matrix("smoke")
    for command in ("probe", "gate"):
        result = CliRunner().invoke(app, [command, "--help"], terminal_width=400, env={"COLUMNS": "400"})
        help_text = " ".join(result.output.split())
        assert result.exit_code == 0
        assert "Server dialect: " + " | ".join(("auto", *DIALECTS)) + "." in help_text
        assert f"[default: the matrix's (smoke: {','.join(map(str, smoke.tree_budget))});" in help_text
        assert f"[default: the matrix's (smoke: {smoke.max_tokens[0]}), else 48]" in help_text
        assert f"built-in name ({BUILTINS})" in help_text
