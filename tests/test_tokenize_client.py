"""Counting prompt tokens with the server's tokenizer: each server's answers as its sources document
them, junk read as None, and the HTTP walk over fake servers (httpx.MockTransport, no socket).

The stand-in answers below are labelled with where their shape comes from:
- vLLM: ``TokenizeChatRequest`` / ``TokenizeResponse`` in vllm/entrypoints/openai/protocol.py,
  ``ModelCard.max_model_len``.
- SGLang: ``TokenizeRequest`` / ``TokenizeResponse`` / ``ModelCard`` in
  python/sglang/srt/entrypoints/openai/protocol.py; the native-API notebook's answers
  (docs/basic_usage/native_api: ``/tokenize`` -> count 9, max_model_len 131072 for a server with
  context_len 32768; ``/get_server_info`` -> ``"context_length": null``).
- llama.cpp: tools/server/README.md (``/tokenize``, ``/apply-template``, ``/props``, ``/v1/models``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ddtree_diag.backends import tokenize as tk
from ddtree_diag.workloads.filler import content_text, fill_messages

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]

# --- documented shapes -----------------------------------------------------------------------

VLLM_TOKENIZE = {"count": 21, "max_model_len": 32768, "tokens": list(range(21)), "token_strs": None}
VLLM_MODELS = {"object": "list", "data": [
    {"id": "Qwen/Qwen3-8B", "object": "model", "created": 1, "owned_by": "vllm", "root": "Qwen/Qwen3-8B",
     "parent": None, "max_model_len": 32768, "permission": []}]}
SGLANG_TOKENIZE = {"tokens": [50, 3825, 524, 5707, 11050, 3950, 2022, 36342, 13], "count": 9, "max_model_len": 131072}
SGLANG_MODELS = {"object": "list", "data": [
    {"id": "qwen/qwen2.5-0.5b-instruct", "object": "model", "created": 1, "owned_by": "sglang",
     "root": "qwen/qwen2.5-0.5b-instruct", "parent": None, "max_model_len": 32768}]}
SGLANG_SERVER_INFO = {"model_path": "qwen/qwen2.5-0.5b-instruct", "context_length": None, "max_total_tokens": 20480,
                      "status": "ready", "max_total_num_tokens": 20480, "max_req_input_len": 20474}
LLAMACPP_TOKENIZE = {"tokens": [123, 456, 789]}
LLAMACPP_TOKENIZE_PIECES = {"tokens": [{"id": 123, "piece": "Hello"}, {"id": 456, "piece": " world"},
                                       {"id": 198, "piece": [195]}]}
LLAMACPP_TEMPLATE = {"prompt": "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"}
LLAMACPP_PROPS = {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": 1024, "speculative": False,
                                                  "params": {"n_predict": -1}},
                  "total_slots": 1, "model_path": "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
                  "chat_template": "...", "build_info": "b(build number)-(build commit hash)"}
LLAMACPP_MODELS = {"object": "list", "data": [
    {"id": "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "object": "model", "created": 1735142223,
     "owned_by": "llamacpp", "meta": {"vocab_type": 2, "n_vocab": 128256, "n_ctx_train": 131072}}]}

JUNK = [None, [], "text", 42, {"count": "21"}, {"count": True}, {"count": -3}, {"count": float("nan")},
        {"count": 1e30}, {"count": 2.5}, {"count": [9, 4]}, {"tokens": "abc"}, {"tokens": [1, "x"]},
        {"tokens": [1, True]}, {"tokens": [-1]}, {"tokens": []}, {"tokens": [{"piece": "no id"}]}, {}]


# --- pure parsing ----------------------------------------------------------------------------


def test_numbers_are_positive_integers_or_none():
    assert tk.token_number(32768) == 32768 and tk.token_number(32768.0) == 32768
    for junk in (None, True, False, 0, -1, 2.5, float("nan"), float("inf"), "32768", 1e30, 1 << 40, [1], {}):
        assert tk.token_number(junk) is None


def test_vllm_tokenize_answer():
    assert tk.parse_tokenize(VLLM_TOKENIZE) == (21, 32768)


def test_sglang_tokenize_answer():
    assert tk.parse_tokenize(SGLANG_TOKENIZE) == (9, 131072)


def test_a_tokens_list_without_count_is_counted():
    assert tk.parse_tokenize({"tokens": [5, 6, 7]}) == (3, None)


@pytest.mark.parametrize("junk", JUNK)
def test_junk_tokenize_answers_read_as_none(junk):
    count, _ = tk.parse_tokenize(junk)
    assert count is None


def test_sglang_batch_counts_are_not_one_count():
    assert tk.parse_tokenize({"tokens": [[1, 2], [3]], "count": [2, 1], "max_model_len": 4096}) == (None, 4096)


def test_llamacpp_tokenize_answers():
    assert tk.parse_llamacpp_tokenize(LLAMACPP_TOKENIZE) == 3
    assert tk.parse_llamacpp_tokenize(LLAMACPP_TOKENIZE_PIECES) == 3
    for junk in JUNK:
        assert tk.parse_llamacpp_tokenize(junk) is None


def test_llamacpp_apply_template_answer():
    assert tk.parse_apply_template(LLAMACPP_TEMPLATE) == LLAMACPP_TEMPLATE["prompt"]
    for junk in (None, {}, {"prompt": ""}, {"prompt": 5}, {"prompt": ["a"]}, "prompt", []):
        assert tk.parse_apply_template(junk) is None


def test_context_from_model_lists():
    assert tk.parse_models_context(VLLM_MODELS) == 32768
    assert tk.parse_models_context(SGLANG_MODELS) == 32768
    assert tk.parse_models_context(LLAMACPP_MODELS) is None  # n_ctx_train is the training context, not the served one
    two = {"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 8192}]}
    assert tk.parse_models_context(two) == 4096
    assert tk.parse_models_context(two, model="b") == 8192
    assert tk.parse_models_context(two, model="missing") == 4096
    for junk in (None, {}, {"data": "x"}, {"data": [None, 3, {"max_model_len": "4096"}]}, [VLLM_MODELS]):
        assert tk.parse_models_context(junk) is None


def test_context_from_llamacpp_props():
    assert tk.parse_props_context(LLAMACPP_PROPS) == 1024
    assert tk.parse_props_context({"n_ctx": 2048}) == 2048  # older builds
    for junk in (None, {}, {"default_generation_settings": {"n_ctx": 0}}, {"default_generation_settings": []}):
        assert tk.parse_props_context(junk) is None


def test_context_from_sglang_server_info():
    assert tk.parse_sglang_server_info(SGLANG_SERVER_INFO) is None  # context_length unset
    assert tk.parse_sglang_server_info({**SGLANG_SERVER_INFO, "context_length": 65536}) == 65536
    assert tk.parse_sglang_server_info("junk") is None


def test_request_bodies():
    body = tk.chat_tokenize_body(MESSAGES, model="m", chat_template_kwargs={"enable_thinking": False})
    assert body == {"messages": MESSAGES, "add_generation_prompt": True, "model": "m",
                    "chat_template_kwargs": {"enable_thinking": False}}
    assert tk.chat_tokenize_body(MESSAGES) == {"messages": MESSAGES, "add_generation_prompt": True}
    assert tk.text_tokenize_body("hi") == {"prompt": "hi", "add_special_tokens": True}
    assert tk.apply_template_body(MESSAGES) == {"messages": MESSAGES}
    assert tk.llamacpp_tokenize_body("p") == {"content": "p", "add_special": True, "parse_special": True}
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]}]
    assert tk.messages_text(MESSAGES) == "Be brief.\nWhat is 2 + 2?"
    assert tk.messages_text(parts) == "a\nb"


# --- over HTTP: fake servers -----------------------------------------------------------------

Route = Callable[[dict], "tuple[int, object]"]


class FakeServer:
    """Answers (METHOD, PATH) from a table; anything else is 404. Records what was asked."""

    def __init__(self, routes: dict[tuple[str, str], Route | object]) -> None:
        self.routes = routes
        self.asked: list[tuple[str, str, object]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.asked.append((request.method, request.url.path, body))
        answer = self.routes.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if callable(answer):
            status, payload = answer(body)
        else:
            status, payload = answer if isinstance(answer, tuple) else (200, answer)
        if isinstance(payload, bytes):
            return httpx.Response(status, content=payload)
        return httpx.Response(status, json=payload)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handle))

    def paths(self) -> list[str]:
        return [f"{method} {path}" for method, path, _ in self.asked]


def vllm_server(count_of: Callable[[dict], int] = lambda body: 21) -> FakeServer:
    def tokenize(body):
        if "messages" not in body:
            return 400, {"error": "prompt route not used here"}
        count = count_of(body)
        return 200, {"count": count, "max_model_len": 32768, "tokens": list(range(count))}

    return FakeServer({("POST", "/tokenize"): tokenize, ("GET", "/v1/models"): VLLM_MODELS})


def sglang_server(*, models=SGLANG_MODELS, messages_ok=True) -> FakeServer:
    def tokenize(body):
        if "messages" in body and not messages_ok:
            return 422, {"detail": [{"msg": "Field required", "loc": ["body", "prompt"]}]}
        return 200, SGLANG_TOKENIZE

    routes = {("POST", "/v1/tokenize"): tokenize, ("POST", "/tokenize"): tokenize,
              ("GET", "/server_info"): SGLANG_SERVER_INFO}
    if models is not None:
        routes[("GET", "/v1/models")] = models
    return FakeServer(routes)


def llamacpp_server() -> FakeServer:
    def tokenize(body):  # llama.cpp answers a body without "content" with no tokens, status 200
        return 200, LLAMACPP_TOKENIZE if "content" in body else {"tokens": []}

    return FakeServer({("POST", "/tokenize"): tokenize, ("POST", "/apply-template"): LLAMACPP_TEMPLATE,
                       ("GET", "/props"): LLAMACPP_PROPS, ("GET", "/v1/models"): LLAMACPP_MODELS})


def test_vllm_counts_the_chat_and_names_its_context():
    server = vllm_server()
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://vllm:8000/v1/", MESSAGES, model="Qwen/Qwen3-8B",
                                        chat_template_kwargs={"enable_thinking": False})
    assert result == tk.TokenCount(count=21, max_context=32768, source="vLLM /tokenize", estimated=False,
                                   route="vllm", context_source="/v1/models max_model_len")
    method, path, body = server.asked[0]
    assert (method, path) == ("POST", "/tokenize")  # the /v1 of the URL is not part of the tokenizer's path
    assert body == {"messages": MESSAGES, "add_generation_prompt": True, "model": "Qwen/Qwen3-8B",
                    "chat_template_kwargs": {"enable_thinking": False}}


def test_vllm_context_from_the_tokenize_answer_when_models_has_none():
    server = vllm_server()
    server.routes[("GET", "/v1/models")] = {"data": [{"id": "m"}]}
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://vllm", MESSAGES)
    assert (result.max_context, result.context_source) == (32768, "/tokenize max_model_len")


def test_sglang_context_comes_from_models_not_from_its_tokenizer():
    for dialect in ("sglang", None):
        server = sglang_server()
        with server.client() as client:
            result = tk.count_prompt_tokens(client, "http://sglang:30000", MESSAGES, dialect=dialect)
        assert result.count == 9 and not result.estimated
        assert result.max_context == 32768  # not the tokenizer's 131072
    assert server.paths()[0] == "POST /tokenize"  # SGLang's alias answers the vLLM route


def test_sglang_first_route_when_the_dialect_says_so():
    server = sglang_server()
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://sglang", MESSAGES, dialect="sglang", with_context=False)
    assert result.route == "sglang" and result.source == "SGLang /v1/tokenize" and result.max_context is None
    assert server.paths() == ["POST /v1/tokenize"]


def test_sglang_tokenizer_limit_is_never_taken_for_the_context():
    server = sglang_server(models=None)
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://sglang", MESSAGES, dialect="sglang")
    assert result.count == 9 and result.max_context is None
    assert "GET /server_info" in server.paths() and "GET /get_server_info" in server.paths()
    server.routes[("GET", "/server_info")] = {**SGLANG_SERVER_INFO, "context_length": 16384}
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://sglang", MESSAGES, dialect="sglang")
    assert (result.max_context, result.context_source) == (16384, "SGLang /server_info context_length")


def test_older_sglang_counts_the_text_and_says_the_template_is_estimated():
    server = sglang_server(messages_ok=False)
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://sglang", MESSAGES)
    overhead = tk.TEMPLATE_TOKENS_PER_MESSAGE * 2 + tk.TEMPLATE_TOKENS_REPLY
    assert result.count == 9 + overhead and result.estimated and result.route == "text"
    text_body = server.asked[[p for _, p, _ in server.asked].index("/v1/tokenize", 2)][2]
    assert text_body == {"prompt": "Be brief.\nWhat is 2 + 2?", "add_special_tokens": True}


def test_llamacpp_renders_the_template_then_tokenizes_it():
    server = llamacpp_server()
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://llama:8080", MESSAGES)
    assert result == tk.TokenCount(count=3, max_context=1024, source="llama.cpp /apply-template + /tokenize",
                                   estimated=False, route="llamacpp", context_source="llama.cpp /props n_ctx")
    asked = {(m, p): b for m, p, b in server.asked}
    assert asked[("POST", "/apply-template")] == {"messages": MESSAGES}
    tokenized = [b for m, p, b in server.asked if p == "/tokenize" and "content" in b]
    assert tokenized == [{"content": LLAMACPP_TEMPLATE["prompt"], "add_special": True, "parse_special": True}]


def test_llamacpp_route_first_with_its_dialect():
    server = llamacpp_server()
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://llama", MESSAGES, dialect="llamacpp", with_context=False)
    assert result.count == 3
    assert server.paths() == ["POST /apply-template", "POST /tokenize"]


def test_a_server_without_any_of_it_gives_none():
    server = FakeServer({("GET", "/v1/models"): {"data": [{"id": "gpt"}]}})
    with server.client() as client:
        assert tk.count_prompt_tokens(client, "http://openai", MESSAGES) is None


def test_context_alone_is_still_told():
    server = FakeServer({("GET", "/v1/models"): VLLM_MODELS})
    with server.client() as client:
        result = tk.count_prompt_tokens(client, "http://x", MESSAGES)
    assert result.count is None and result.max_context == 32768 and result.source == "no tokenize endpoint"


@pytest.mark.parametrize("answer", [
    (200, b"<html>not json</html>"),
    (200, b"\xff\xfe"),
    (200, b"[" * 100_000),
    (200, b'{"count": NaN, "max_model_len": Infinity}'),
    (200, {"count": 1e300, "max_model_len": -1}),
    (200, {"count": "12", "tokens": "abc"}),
    (500, {"count": 12}),
    (302, b""),
    (200, b""),
])
def test_junk_answers_give_none_and_never_raise(answer):
    server = FakeServer({(method, path): answer for method, path in [
        ("POST", "/tokenize"), ("POST", "/v1/tokenize"), ("POST", "/apply-template"), ("GET", "/v1/models"),
        ("GET", "/props"), ("GET", "/server_info"), ("GET", "/get_server_info")]})
    with server.client() as client:
        assert tk.count_prompt_tokens(client, "http://junk", MESSAGES) is None


def test_an_oversized_answer_is_not_read():
    huge = b'{"count": 5, "tokens": [' + b"1," * (tk.MAX_BODY_BYTES // 2) + b"1]}"
    server = FakeServer({("POST", "/tokenize"): (200, huge)})
    with server.client() as client:
        assert tk.count_prompt_tokens(client, "http://big", MESSAGES, with_context=False) is None


def test_transport_failures_give_none():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        assert tk.count_prompt_tokens(client, "http://down", MESSAGES) is None
    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        assert tk.count_prompt_tokens(client, "not a url at all", MESSAGES) is None


def test_the_counter_pins_the_route_that_answered():
    server = llamacpp_server()
    with server.client() as client:
        count = tk.token_counter(client, "http://llama")
        assert count(MESSAGES) == 3
        first = len(server.asked)
        assert count(MESSAGES) == 3
    assert server.paths()[first:] == ["POST /apply-template", "POST /tokenize"]
    assert "GET /props" not in server.paths()  # the counter never looks for the context


def test_the_counter_skips_the_text_route():
    server = sglang_server(messages_ok=False)
    with server.client() as client:
        assert tk.token_counter(client, "http://sglang")(MESSAGES) is None


def test_filling_a_prompt_through_a_vllm_tokenizer():
    """The filler sized by a server that counts a token per 3.5 characters plus its template."""
    def count_of(body):
        return 3 + sum(6 + len(content_text(m.get("content"))) * 2 // 7 for m in body["messages"])

    server = vllm_server(count_of)
    with server.client() as client:
        result = fill_messages(MESSAGES, 16384, count_tokens=tk.token_counter(client, "http://vllm"))
    assert not result.estimated
    assert 16384 * 0.98 <= result.tokens <= 16384
    assert result.tokens == count_of({"messages": result.messages})
    assert len(server.asked) <= 1 + 1 + 6


# --- one real socket -------------------------------------------------------------------------


@pytest.mark.e2e
def test_over_a_real_loopback_server():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            payload = json.dumps({"count": len(json.dumps(body["messages"])) // 4, "max_model_len": 8192,
                                  "tokens": []}).encode()
            self.send_response(200 if self.path == "/tokenize" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with httpx.Client() as client:
            result = tk.count_prompt_tokens(client, f"http://127.0.0.1:{server.server_port}", MESSAGES, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert result.count == len(json.dumps(MESSAGES)) // 4
    assert (result.max_context, result.source) == (8192, "vLLM /tokenize")
