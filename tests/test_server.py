"""The reference server (`ddtree-diag serve`) as a real subprocess, probed by the real client.

A tiny random-weight Qwen3 target + DFlash draft (tests/support/engine_fixtures.py) keeps it fast; the
text is gibberish, which is fine here: this file tests the wire, not the words.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.support.engine_fixtures import serving, start_server, tiny_models  # noqa: E402
from tests.support.processes import free_port  # noqa: E402

pytestmark = pytest.mark.engine
API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(models):
    with serving(*models, "--api-key", API_KEY) as url:
        yield url


def post(url: str, body, *, key: str | None = API_KEY, raw: bytes | None = None, timeout: float = 60):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{url}/v1/chat/completions", content=raw, headers=headers, timeout=timeout)
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0, **kw}


def test_health_models_and_metrics(server):
    health = httpx.get(f"{server}/health").json()
    assert health["ready"] is True and health["block_size"] == 4 and health["device"] == "cpu"
    assert health["workers"] == 1  # the load sweep's note: requests queue for the one engine worker
    models = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert models["data"][0]["owned_by"] == "ddtree-diag"
    page = httpx.get(f"{server}/metrics").text
    assert "ddtree_spec_decode_num_drafts_total" in page and "ddtree_request_latency_seconds" in page


def test_engine_and_server_report_one_model_name(server, models, capsys):
    from ddtree_diag.backends import EngineTarget, make_backend
    from ddtree_diag.commands.engine_info import run_engine_info
    from ddtree_diag.records import ProbeCase

    target, draft = models
    served = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
    reply = post(server, chat("hi", max_tokens=2)).json()["model"]
    assert run_engine_info(str(target), None, str(draft), "cpu", "fp32", as_json=True) == 0
    info = json.loads(capsys.readouterr().out)["model"]
    backend = make_backend(EngineTarget(target=str(target), draft=str(draft), device="cpu", dtype="fp32"))
    try:
        backend.prepare([])
        in_process = backend.run(ProbeCase("p", [{"role": "user", "content": "hi"}], max_tokens=2)).model
        reported = backend.target_info()["model"]
    finally:
        backend.close()
    assert served == reply == info == in_process == reported == target.name


def test_probe_reads_rounds_and_acceptance(server, cli):
    result = cli("probe", "--url", server, "--json", "-", "--max-tokens", "24", env={"DDTREE_DIAG_API_KEY": API_KEY})
    assert result.code in (0, 1), result.stderr  # random weights may be flagged as garbage
    report = json.loads(result.stdout)
    assert report["target"]["dialect"] == "ddtree"
    for record in report["results"]:
        assert record["status"] == "ok", record["error"]
        spec = record["spec"]
        assert spec["decode_rounds"] >= 1 and spec["mean_acceptance_length"] >= 1
        assert spec["tree_budget"] == record["case"]["tree_budget"]
        assert len(spec["acceptance_lengths"]) == spec["decode_rounds"]
        # committed after the first token == sum of per-round acceptance
        assert sum(spec["acceptance_lengths"]) == record["completion_tokens"] - 1


def test_stream_and_plain_agree_at_t0(server):
    plain = post(server, chat("abc def", tree_budget=8)).json()
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json=chat("abc def", tree_budget=8, stream=True,
                                stream_options={"include_usage": True})) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    assert usage_chunk["ddtree"]["decode_rounds"] == plain["ddtree"]["decode_rounds"]


def test_server_text_equals_in_process_engine(server, models):
    from ddtree_diag.engine import load_engine

    target, draft = models
    engine = load_engine(target, draft=draft, device="cpu", dtype="fp32")
    for thinking in (False, True):
        for budget in (0, 4, 16):
            body = chat("Tell me a story.", tree_budget=budget, enable_thinking=thinking)
            served = post(server, body).json()
            local = engine.generate(messages=body["messages"], enable_thinking=thinking, tree_budget=budget,
                                    max_tokens=24)
            message = served["choices"][0]["message"]
            # thinking on: the server reads the text as a reasoning parser does (the tiny template
            # does not open a think block): reasoning and content together are the engine's text
            text = (message.get("reasoning_content") or "") + (message["content"] or "")
            assert text == local.text
            assert served["ddtree"]["acceptance_lengths"] == local.acceptance_lengths


def test_thinking_knobs_are_equivalent(server):
    top = post(server, chat("x y", enable_thinking=False)).json()
    kwargs = post(server, chat("x y", chat_template_kwargs={"enable_thinking": False})).json()
    assert top["choices"][0]["message"]["content"] == kwargs["choices"][0]["message"]["content"]


def test_logprobs_are_returned(server):
    body = post(server, chat("hello", logprobs=True, top_logprobs=3, max_tokens=5)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["top_logprobs"][1]["logprob"]


def test_a_sampled_token_carries_its_own_logprob(server):
    """At T=1 a token outside the top one gets its own log-prob, below the top one's (not the top
    one's value, nor the lowest of the top ones)."""
    below = 0
    for seed in range(4):
        body = post(server, chat("hello", logprobs=True, top_logprobs=1, max_tokens=12, temperature=1.0,
                                 seed=seed)).json()
        for entry in body["choices"][0]["logprobs"]["content"]:
            best = entry["top_logprobs"][0]
            assert entry["logprob"] <= best["logprob"] + 1e-6
            if entry["token"] != best["token"]:
                assert entry["logprob"] < best["logprob"]
                below += 1
    assert below > 0


@pytest.mark.parametrize(
    "body, raw, status, needle",
    [(None, b"{not json", 400, "invalid JSON"),
     ({"max_tokens": 5}, None, 400, "messages"),
     ({"messages": []}, None, 400, "messages"),
     ({"messages": "hi"}, None, 400, "messages"),
     ({"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "role"),
     (chat("x", max_tokens="lots"), None, 400, "max_tokens"),
     (chat("x", max_tokens=-5), None, 400, "max_tokens"),
     (chat("x", max_tokens=10**9), None, 400, "context length"),
     (chat("x", temperature="hot"), None, 400, "temperature"),
     (chat("x", tree_budget=-1), None, 400, "tree_budget"),
     (chat("x", model="gpt-9"), None, 404, "does not exist"),
     ([1, 2], None, 400, "JSON object"),
     (None, b'{"messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}', 413, "body over")],
)
def test_bad_input_is_4xx_with_openai_error_and_server_survives(server, body, raw, status, needle):
    response = post(server, body, raw=raw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert httpx.get(f"{server}/health").status_code == 200
    assert post(server, chat("still alive", max_tokens=3)).status_code == 200


@pytest.mark.parametrize(
    "fields, param",
    [({"stream": "yes"}, "stream"),
     ({"stream": 1}, "stream"),
     ({"stream": "true"}, "stream"),
     ({"logprobs": "yes"}, "logprobs"),
     ({"logprobs": 0}, "logprobs"),
     ({"enable_thinking": "no"}, "enable_thinking"),
     ({"enable_thinking": 0}, "enable_thinking"),
     ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
     ({"chat_template_kwargs": {"enable_thinking": 1}}, "chat_template_kwargs.enable_thinking"),
     ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage")],
)
def test_wrong_typed_booleans_are_400_naming_the_field(server, fields, param):
    response = post(server, chat("x", max_tokens=3, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] == f"{param}: must be a JSON boolean (true or false)"


def test_real_booleans_and_other_template_kwargs_still_work(server):
    for fields in ({"stream": False, "logprobs": False, "enable_thinking": None},
                   {"chat_template_kwargs": {"enable_thinking": False, "custom": "kept"}}):
        assert post(server, chat("x", max_tokens=3, **fields)).status_code == 200


def test_api_key_is_required(server):
    assert post(server, chat("x"), key=None).status_code == 401
    assert post(server, chat("x"), key="wrong").status_code == 401


def test_concurrent_clients_get_their_own_answers(server):
    prompts = [f"question number {i} " * (i + 1) for i in range(6)]
    serial = {p: post(server, chat(p, max_tokens=12 + i)).json()["choices"][0]["message"]["content"]
              for i, p in enumerate(prompts)}
    answers: dict[str, str] = {}

    def ask(i: int, prompt: str) -> None:
        answers[prompt] = post(server, chat(prompt, max_tokens=12 + i)).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == serial


def cancelled_count(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('ddtree_requests_total{status="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_mid_stream_cancels_and_frees_the_worker(server):
    before = cancelled_count(server)
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json=chat("go on forever", max_tokens=400, tree_budget=0, stream=True)) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    # the client is gone; the generation stops at its next round and the worker takes new work
    deadline = time.time() + 30
    while cancelled_count(server) <= before and time.time() < deadline:
        time.sleep(0.1)
    assert cancelled_count(server) == before + 1
    assert post(server, chat("next", max_tokens=3), timeout=30).status_code == 200


@pytest.mark.e2e
def test_sigterm_shuts_down_cleanly(models):
    process, url = start_server(models[0], None)
    assert httpx.get(f"{url}/health").json()["draft"] is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1)


def test_load_failure_is_one_line_exit_2(cli, tmp_path):
    result = cli("serve", "--target", str(tmp_path / "missing"), "--port", str(free_port()))
    assert result.code == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_port_in_use_is_exit_2(cli, models):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = cli("serve", "--target", str(models[0]), "--port", str(port))
    assert result.code == 2 and "cannot listen" in result.stderr


def test_demo_probes_a_started_server_and_stops_it(models, cli):
    target, draft = models
    result = cli("demo", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--json", "-")
    assert result.code in (0, 1), result.stderr  # random weights: garbage may be flagged
    report = json.loads(result.stdout)
    assert report["target"]["dialect"] == "ddtree" and len(report["results"]) == 4
    assert all(r["status"] == "ok" and r["spec"]["decode_rounds"] for r in report["results"])
    url = report["target"]["url"]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1)  # the demo stopped its server
