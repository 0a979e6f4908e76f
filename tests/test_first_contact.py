"""First contact with a server: a --model it does not serve, and a --url whose path is wrong, are
told before (or with) the first case, naming what was asked for and what the server has.

The CLI tests run the real CLI against the STAND-IN server (tests/support/standin_server.py), which lists
one model, ``standin-model``, and answers 404 on any other path. The unit tests script /v1/models
through httpx.MockTransport (no socket).
"""

from __future__ import annotations

import json

import httpx
import pytest

from ddtree_diag.backends.http import HttpBackend
from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase

CASE = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
CHAT = {"choices": [{"message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def backend(models_reply: httpx.Response | None, *, model: str | None = "gpt-4", dialect: str = "openai",
            url: str = "http://server.invalid:8000", dead_path: str | None = None,
            any_model: bool = False) -> tuple[HttpBackend, list[str]]:
    """A backend on a scripted server: ``models_reply`` for /v1/models (None: 404), a completion for
    /v1/chat/completions (404 for a model the list lacks, unless ``any_model``), 404 for anything
    else and for everything under ``dead_path``."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append(f"{request.method} {path}")
        if dead_path and path.startswith(dead_path):
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        if path.endswith("/v1/models") and models_reply is not None:
            return models_reply
        if path.endswith("/v1/chat/completions"):
            listed = models_reply.json().get("data") if models_reply is not None and models_reply.is_success else None
            asked = json.loads(request.content).get("model")
            if not any_model and isinstance(listed, list) and listed and asked not in [m.get("id") for m in listed]:
                return httpx.Response(404, json={"error": {"message": f"The model `{asked}` does not exist."}})
            return httpx.Response(200, json=CHAT)
        return httpx.Response(404, json={"error": {"message": "not found"}})

    transport = httpx.MockTransport(handler)
    return HttpBackend(url, model=model, dialect=dialect, stream=False, timeout=5, transport=transport), seen


# -- a model the server does not serve ---------------------------------------------------------


@pytest.mark.parametrize("dialect", ["openai", "auto"])
def test_unserved_model_is_a_usage_error_naming_the_served_ids(dialect):
    ids = [f"org/model-{i}" for i in range(8)]
    made, seen = backend(httpx.Response(200, json={"data": [{"id": i} for i in ids]}), dialect=dialect)
    with pytest.raises(UsageError) as caught:
        made.prepare([CASE])
    message = str(caught.value)
    assert "--model 'gpt-4' is not served" in message and "\n" not in message
    assert "'org/model-0', 'org/model-1'" in message and "(8 in all)" in message and "org/model-7" not in message
    assert "a 1-token request for it answered HTTP 404" in message
    assert seen == ["GET /v1/models", "POST /v1/chat/completions"], "nothing but the 1-token check was sent"


def test_unlisted_model_that_the_server_answers_is_a_note():
    made, _seen = backend(httpx.Response(200, json={"data": [{"id": "a"}]}), any_model=True)
    notes = made.prepare([CASE])
    assert any("'gpt-4' is not listed by /v1/models" in n for n in notes) and made.run(CASE).status == "ok"


@pytest.mark.parametrize("reply", [
    httpx.Response(404, json={"error": {"message": "not found"}}),
    httpx.Response(200, json={"object": "list"}),
    httpx.Response(200, json={"data": []}),
    httpx.Response(500, text="oops"),
    httpx.Response(401, json={"error": {"message": "key"}}),
])
def test_without_a_model_list_the_run_goes_on(reply):
    made, _seen = backend(reply)
    made.prepare([CASE])
    assert made.model == "gpt-4" and made.run(CASE).status == "ok"


def test_a_listed_model_is_taken():
    made, _seen = backend(httpx.Response(200, json={"data": [{"id": "a"}, {"id": "gpt-4"}]}))
    made.prepare([CASE])
    assert made.run(CASE).status == "ok"


def test_odd_model_ids_stay_on_one_line():
    made, _seen = backend(httpx.Response(200, json={"data": [{"id": "line\nbreak"}, {"id": "x" * 500}]}),
                          model="want\nthis")
    with pytest.raises(UsageError) as caught:
        made.prepare([CASE])
    assert "\n" not in str(caught.value) and "want\\nthis" in str(caught.value)


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [(), ("--dialect", "vllm")])
def test_cli_unserved_model_exits_2_before_any_case(standin, cli, extra):
    server = standin("--dialect", "ddtree")
    result = cli("probe", "--url", server.url, "--model", "gpt-4", *extra)
    assert result.code == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--model 'gpt-4' is not served" in result.stderr and "'standin-model'" in result.stderr
    assert "answered HTTP 404" in result.stderr
    assert [r["max_tokens"] for r in server.requests()] == [1], "only the 1-token model check was sent"


@pytest.mark.e2e
def test_cli_unlisted_model_that_the_server_answers_goes_on(standin, cli):
    """llama.cpp and SGLang answer any model name: unlisted is not unserved there."""
    server = standin("--dialect", "llamacpp", "--any-model")
    result = cli("probe", "--url", server.url, "--model", "my-alias", "--thinking", "off", "--json", "-")
    assert result.code == 0, result.stderr
    assert any("'my-alias' is not listed by /v1/models" in n and "answered it anyway" in n
               for n in result.json()["notes"])


# -- a wrong path in --url ---------------------------------------------------------------------


def test_wrong_path_names_the_url_and_where_the_server_answers():
    made, _seen = backend(httpx.Response(200, json={"data": [{"id": "gpt-4"}]}), model=None,
                          url="http://user:secret@server.invalid:8000/foo/bar", dead_path="/foo/bar")
    with pytest.raises(UsageError) as caught:
        made.prepare([CASE])
    message = str(caught.value)
    assert "GET http://user:***@server.invalid:8000/foo/bar/v1/models answered HTTP 404" in message
    assert "'/foo/bar' in --url looks wrong" in message and "try --url http://user:***@server.invalid:8000" in message
    assert "secret" not in message and "pass --model" not in message
    made.model = "gpt-4"  # with --model the cases run, and each 404 says where and why
    made.prepare([CASE])
    error = made.run(CASE).error
    assert error.startswith("HTTP 404 from http://user:***@server.invalid:8000/foo/bar/v1/chat/completions: ")
    assert "looks wrong" in error and "secret" not in error


def test_404_without_a_path_names_the_url_without_a_path_hint():
    made, _seen = backend(None, model=None)
    with pytest.raises(UsageError) as caught:
        made.prepare([CASE])
    assert str(caught.value) == ("GET http://server.invalid:8000/v1/models answered HTTP 404: not found; "
                                 "pass --model NAME (or check the path in --url)")
    made, _seen = backend(None, model=None, url="http://server.invalid:8000/foo", dead_path="/")
    with pytest.raises(UsageError) as caught:  # the root does not answer either: no guess
        made.prepare([CASE])
    assert "looks wrong" not in str(caught.value) and "/foo/v1/models answered HTTP 404" in str(caught.value)


@pytest.mark.e2e
def test_cli_wrong_path(standin, cli):
    server = standin("--dialect", "ddtree")
    port_url = server.url.replace("http://", "http://probe:hunter2@")
    result = cli("probe", "--url", f"{port_url}/foo/bar")
    assert result.code == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "hunter2" not in line
    assert f"{port_url.replace('hunter2', '***')}/foo/bar/v1/models answered HTTP 404" in line
    assert f"try --url {port_url.replace('hunter2', '***')}" in line
    result = cli("probe", "--url", f"{server.url}/foo/bar", "--model", "standin-model", "--thinking", "off",
                 "--json", "-")
    report = json.loads(result.stdout)
    errors = [r["error"] for r in report["results"]]
    assert errors and all(e.startswith(f"HTTP 404 from {server.url}/foo/bar/v1/chat/completions: ") for e in errors)
    assert all(f"try --url {server.url}" in e for e in errors)
