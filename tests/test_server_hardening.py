"""The reference server never answers client input with a 5xx, and one client cannot hold its
single worker for minutes. ``ddtree-diag serve`` runs as a real subprocess with a tiny random
model (tests/support/engine_fixtures.py); requests go over loopback HTTP.

The fuzz test sends hypothesis-generated request bodies (derandomized, a fixed count) and checks
that every answer is a 2xx completion or a 4xx OpenAI error object, that streams end properly or
with an SSE error event, and that the server is still healthy and answering afterwards.
"""

from __future__ import annotations

import json
import math
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support.engine_fixtures import serving, tiny_models  # noqa: E402
from tests.support.timing import DEADLINE_SLACK_S, fuzz_examples  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.e2e]
FUZZ_EXAMPLES = fuzz_examples(200)  # `make fuzz`: 800
LIMITS = ("--max-context", "160", "--max-tree-budget", "16", "--request-timeout", "30")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(models):
    with serving(*models, *LIMITS) as url:
        yield url


def post(url: str, *, json_body=None, raw: bytes | None = None, content_type: str | None = "application/json",
         timeout: float = 60) -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    data = raw if raw is not None else json.dumps(json_body, allow_nan=True).encode("utf-8", "surrogatepass")
    return httpx.post(f"{url}/v1/chat/completions", content=data, headers=headers, timeout=timeout)


def chat(content="Say hi.", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **fields}


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a 4xx answer (fails the test if the shape is wrong)."""
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"], body
    return error


@pytest.mark.parametrize(
    "body, raw, needle",
    [(None, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper"),
     (None, b'{"messages": [{"role": "user", "content": ' + b"[" * 70 + b"]" * 70 + b"}]}", "nested deeper"),
     (chat("\ud800 lone surrogate"), None, "lone UTF-16 surrogate"),
     (chat([{"type": "text", "text": "a\udfffb"}]), None, "messages[0].content[0].text"),
     (chat(temperature=1e-300), None, "too small to sample"),
     (chat(temperature=5e-324), None, "too small to sample"),
     (chat(seed=2**64), None, "seed"),
     (chat(seed=2**70), None, "seed"),
     (chat(seed=-(2**63) - 1), None, "seed"),
     (chat(max_tokens=True), None, "max_tokens"),
     (chat(max_tokens="8"), None, "max_tokens"),
     (chat(temperature="0.5"), None, "temperature"),
     (chat(temperature=False), None, "temperature"),
     (chat(tree_budget=True), None, "tree_budget"),
     (chat(top_logprobs="3", logprobs=True), None, "top_logprobs"),
     (None, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "finite number"),
     (None, b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', "finite number"),
     (None, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', "finite number"),
     (chat(tree_budget=17), None, "--max-tree-budget"),
     (chat(max_tokens=500), None, "context length 160"),
     (None, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid JSON"),
     ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 9}, None, "stop")],
)
def test_client_mistakes_are_400_with_an_error_object(server, body, raw, needle):
    response = post(server, json_body=body, raw=raw)
    assert response.status_code == 400, response.text
    assert needle in error_of(response)["message"]


def test_seed_range_is_64_bits(server):
    for seed in (2**64 - 1, -(2**63), 0):
        assert post(server, json_body=chat(temperature=0.7, seed=seed, max_tokens=2)).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_non_json_content_type_is_415(server, content_type):
    response = post(server, json_body=chat(), content_type=content_type)
    assert response.status_code == 415
    assert "application/json" in error_of(response)["message"]
    short = chat(max_tokens=2)
    assert post(server, json_body=short, content_type="application/json; charset=utf-8").status_code == 200
    assert post(server, json_body=short, content_type=None).status_code == 200  # no Content-Type: read as JSON


def test_unknown_paths_and_methods_get_openai_errors(server):
    assert error_of(httpx.get(f"{server}/v1/nothing"))["type"] == "not_found_error"
    response = httpx.get(f"{server}/v1/chat/completions")
    assert response.status_code == 405 and error_of(response)


def test_health_shows_the_limits(server):
    limits = httpx.get(f"{server}/health").json()["limits"]
    assert limits == {"max_tree_budget": 16, "max_context": 160, "request_timeout_s": 30.0, "max_body_bytes": 1 << 20}
    assert httpx.get(f"{server}/health").json()["tree_budget_default"] == 16  # the engine's 64, capped


def stream_events(url: str, body: dict) -> tuple[int, list]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return 200, [e if e == "[DONE]" else json.loads(e) for e in events]


def test_prompt_over_the_context_is_a_400_or_an_sse_error_event(server):
    long = "word " * 400
    response = post(server, json_body=chat(long))
    assert response.status_code == 400 and "context length 160" in error_of(response)["message"]
    status, events = stream_events(server, chat(long, stream=True))
    assert status == 200  # the status line was sent before the prompt was read: the error is an event
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "context length 160" in errors[0]["error"]["message"]
    assert errors[0]["error"]["code"] == 400
    assert events[-1] == "[DONE]"


@pytest.fixture(scope="module")
def impatient_server(models):
    """A server with a 0.1 s per-request deadline: far less than 450 tokens take on any CPU."""
    with serving(*models, "--request-timeout", "0.1") as url:
        yield url


@pytest.mark.timing
def test_request_deadline_frees_the_worker(impatient_server):
    long = {"max_tokens": 450, "tree_budget": 0, "temperature": 0}
    started = time.monotonic()
    response = post(impatient_server, json_body=chat("go on forever", **long))
    elapsed = time.monotonic() - started
    if response.status_code == 200:  # a random model may stop by itself; then there is nothing to cut
        assert response.json()["usage"]["completion_tokens"] < 450
        pytest.skip("the tiny model ended its answer before the deadline")
    assert response.status_code == 408 and elapsed < DEADLINE_SLACK_S
    error = error_of(response)
    assert error["type"] == "timeout_error" and "--request-timeout" in error["message"]
    status, events = stream_events(impatient_server, chat("go on forever", stream=True, **long))
    assert status == 200
    assert any(isinstance(e, dict) and e.get("error", {}).get("code") == "request_timeout" for e in events)
    assert events[-1] == "[DONE]"
    # The worker is free again: a short request is answered at once (not queued behind the long one).
    started = time.monotonic()
    response = post(impatient_server, json_body=chat("next", max_tokens=2, tree_budget=0))
    # 200, or 408 when a loaded machine needs more than the 0.1 s for prefill: either way it was served now.
    assert response.status_code in (200, 408) and time.monotonic() - started < DEADLINE_SLACK_S


# -- the fuzz -------------------------------------------------------------------------------------

JUNK = [None, True, False, 0, -1, 1, 2.5, 1e-300, 5e-324, 1e308, math.nan, math.inf, -math.inf, 2**64, 2**70,
        -(2**63) - 1, "", "x", "\ud800", "0.5", "NaN", [], {}, [1], {"a": 1}, "a" * 5000,
        [{"role": "user"}]]
junk = st.one_of(st.sampled_from(JUNK), st.integers(), st.floats(), st.text(st.characters(exclude_categories=()),
                                                                               max_size=12))
def usually(good, n: int = 4):
    """``good`` n times out of n + 1, else junk."""
    return st.integers(0, n).flatmap(lambda i: junk if i == 0 else good)


FIELDS = {
    "model": st.one_of(st.none(), st.just("x"), junk),
    "max_completion_tokens": usually(st.integers(1, 12)),
    "temperature": usually(st.sampled_from([0, 0.7, 1.0, 2.0, 2.01, 1e-5, 9e-6, 0.3])),
    "stream_options": usually(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": usually(st.lists(st.text(max_size=4), max_size=3)),
    "seed": usually(st.integers(-(2**64), 2**65)),
    "logprobs": usually(st.booleans()),
    "top_logprobs": usually(st.integers(-2, 25)),
    "n": usually(st.integers(0, 3)),
    "enable_thinking": usually(st.booleans()),
    "tree_budget": usually(st.integers(-2, 20)),
    "chat_template_kwargs": usually(st.fixed_dictionaries({"enable_thinking": st.booleans()})),
    "unknown_field": junk,
}
content = usually(st.one_of(st.text(max_size=40), st.text(st.characters(exclude_categories=()), max_size=10),
                            st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                            "text": usually(st.text(max_size=10))}), max_size=3)))
message = usually(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", "wizard"]),
    "content": content,
}), 8)


@st.composite
def request_bodies(draw) -> tuple[bytes, str | None]:
    """(body bytes, Content-Type): mostly chat requests with a few odd fields, sometimes broken
    bytes. Answers stay short (max_tokens <= 12) so the fuzz is quick even on a CPU."""
    messages = draw(usually(st.lists(message, min_size=1, max_size=3), 8))
    body = {"messages": messages, "max_tokens": draw(usually(st.integers(1, 12), 8)),
            "stream": draw(usually(st.booleans(), 8))}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(FIELDS[name])
    if isinstance(body.get("max_completion_tokens"), int) and not isinstance(body["max_completion_tokens"], bool):
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 12)
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["intact"] * 20 + ["truncate", "bytes", "deep", "array", "utf8"]))
    if how == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif how == "bytes":
        data = draw(st.binary(max_size=60))
    elif how == "deep":
        data = b'{"messages": [{"role": "user", "content": "x"}], "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    elif how == "array":
        data = b"[" + data + b"]"
    elif how == "utf8":
        data = data.replace(b"e", b"\xe9", 1)
    content_type = draw(st.sampled_from(["application/json"] * 12 + [None, "text/plain", "application/vnd.x+json"]))
    return data, content_type


def check_answer(response_status: int, payload) -> None:
    assert response_status < 500, payload
    if response_status >= 400:
        assert isinstance(payload, dict) and isinstance(payload["error"]["message"], str), payload


def test_fuzzed_requests_never_get_a_5xx(server):
    seen = {"2xx": 0, "4xx": 0, "stream": 0, "stream_error": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=request_bodies())
    def check(request):
        data, content_type = request
        headers = {} if content_type is None else {"Content-Type": content_type}
        with httpx.stream("POST", f"{server}/v1/chat/completions", content=data, headers=headers,
                          timeout=60) as response:
            status = response.status_code
            streamed = "text/event-stream" in response.headers.get("content-type", "")
            if streamed:
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            else:
                response.read()
        if not streamed:
            payload = response.json()
            check_answer(status, payload)
            seen["2xx" if status < 300 else "4xx"] += 1
            if status < 300:
                assert isinstance(payload["choices"][0]["message"]["content"], str)
            return
        seen["stream"] += 1
        assert status == 200 and events and events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:
                seen["stream_error"] += 1
                assert chunk["error"]["message"] and chunk["error"]["code"] != 500, chunk

    started = time.monotonic()
    check()
    elapsed = time.monotonic() - started
    print(f"\nserver fuzz: {sum(seen.values()) - seen['stream_error']} requests in {elapsed:.1f} s, 0 5xx ({seen})")
    assert seen["2xx"] > 10 and seen["4xx"] > 50 and seen["stream"] > 5, seen
    health = httpx.get(f"{server}/health").json()
    assert health["ready"] is True
    answer = post(server, json_body=chat("still alive?", max_tokens=4))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    page = httpx.get(f"{server}/metrics").text
    assert 'ddtree_requests_total{status="500"}' not in page
