"""Fleet targets: the TOML targets file, patterns, repeated --url, and every bad input as one
UsageError before anything is sent."""

from __future__ import annotations

import pytest

from ddtree_diag.errors import UsageError
from ddtree_diag.targets import from_urls, load_targets


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_pattern_over_urls_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_KEY", "sk-secret")
    path = _file(tmp_path, """
[defaults]
dialect = "vllm"
api_key_env = "FLEET_KEY"

[[target]]
name = "gpu-{n}"
url = "http://gpu-{n}:8000/v1"
n = [1, 2, 3]
""")
    specs = load_targets(path)
    assert [s.name for s in specs] == ["gpu-1", "gpu-2", "gpu-3"]
    assert [s.url for s in specs] == ["http://gpu-1:8000", "http://gpu-2:8000", "http://gpu-3:8000"]
    assert {s.dialect for s in specs} == {"vllm"}
    assert specs[0].api_key == "sk-secret"


def test_plural_variable_fills_singular_and_range(tmp_path):
    path = _file(tmp_path, """
[[target]]
name = "ct-{id}"
via = "ssh root@pve pct exec {id} --"
url = "http://127.0.0.1:8000"
ids = [101, 102]

[[target]]
name = "box-{k}"
url = "http://10.0.0.{k}:9000"
k = "7..9"
""")
    specs = load_targets(path)
    assert [s.name for s in specs] == ["ct-101", "ct-102", "box-7", "box-8", "box-9"]
    assert specs[1].via == "ssh root@pve pct exec 102 --"
    assert specs[4].url == "http://10.0.0.9:9000"


def test_two_variables_make_every_combination(tmp_path):
    path = _file(tmp_path, """
[[target]]
name = "{host}-{port}"
url = "http://{host}:{port}"
host = ["a", "b"]
port = [8000, 8001]
""")
    assert [s.name for s in load_targets(path)] == ["a-8000", "a-8001", "b-8000", "b-8001"]


def test_precedence_target_then_flags_then_defaults(tmp_path):
    path = _file(tmp_path, """
[defaults]
dialect = "sglang"
timeout = 30

[[target]]
name = "own"
url = "http://a:1"
dialect = "llamacpp"

[[target]]
name = "plain"
url = "http://b:1"
""")
    own, plain = load_targets(path, {"dialect": "vllm"})
    assert own.dialect == "llamacpp"  # the target's own key wins
    assert plain.dialect == "vllm"  # the command line beats [defaults]
    assert plain.timeout == 30


def test_repeated_url_names_targets_by_host():
    specs = from_urls(["http://a:8000", "http://b:8000/v1"], {"model": "m"})
    assert [s.name for s in specs] == ["a:8000", "b:8000"]
    assert {s.model for s in specs} == {"m"}


@pytest.mark.parametrize(("text", "words"), [
    ('[[target]]\nname = "x"\nurl = "http://a:1"\n[[target]]\nname = "x"\nurl = "http://b:1"\n',
     ["two targets", "'x'"]),
    ('[[target]]\nurl = "http://a:1"\ncolour = "red"\n', ["unknown key", "colour"]),
    ('[[target]]\nname = "g-{n}"\nurl = "http://g-{n}:1"\nn = []\n', ["expands to nothing"]),
    ('[[target]]\nname = "g-{n}"\nurl = "http://g-{n}:1"\nn = "5..3"\n', ["expands to nothing"]),
    ('[[target]]\nname = "g-{m}"\nurl = "http://g:1"\nn = [1]\n', ["{m}"]),
    ('[[target]]\nname = "g"\nurl = "http://g:1"\nn = [1, 2]\n', ["unknown key", "'n'"]),
    ('[[target]]\nurl = "http://a:1"\napi_key = "sk-1"\n', ["api_key_env"]),
    ('[[target]]\nurl = "http://a:1"\napi_key_env = "NO_SUCH_VARIABLE_FOR_FLEET"\n',
     ["NO_SUCH_VARIABLE_FOR_FLEET", "not set"]),
    ('[[target]]\nname = "a"\n', ["no url"]),
    ('[defaults]\ndialect = "foo"\n[[target]]\nurl = "http://a:1"\n', ["unknown dialect 'foo'", "vllm"]),
    ('[[target]]\nurl = "ftp://a"\n', ["bad --url"]),
    ('[[target]]\nurl = "http://a:1"\ntimeout = "soon"\n', ["timeout must be"]),
    ('[[target]]\nurl = "http://a:1"\ndeadline = 0\n', ["deadline must be"]),
    ('[target]\nurl = "http://a:1"\n[other]\nx = 1\n', ["unknown table", "other"]),
    ("[defaults]\nurl = 'http://a:1'\nwho = 1\n", ["unknown key", "who"]),
    ("", ["no [[target]]"]),
    ("[[target]\n", ["not valid TOML"]),
])
def test_bad_targets_file_is_one_usage_error(tmp_path, monkeypatch, text, words):
    monkeypatch.delenv("NO_SUCH_VARIABLE_FOR_FLEET", raising=False)
    with pytest.raises(UsageError) as info:
        load_targets(_file(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_file_and_duplicate_urls(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_targets(str(tmp_path / "nope.toml"))
    with pytest.raises(UsageError, match="two targets"):
        from_urls(["http://a:1", "http://a:1/v1"])
