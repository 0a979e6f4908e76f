"""A fault proxy: a small real HTTP server in front of a real OpenAI-compatible server (the
project's own ``serve``) that rewrites its real responses to plant one fault.

    proxy = FaultProxy(upstream_url, "collapse").start()   # http://127.0.0.1:<port>
    ...
    proxy.stop()

Every request goes upstream (GETs and other POSTs such as /tokenize as they are; chat
completions as non-streamed JSON), and the upstream chat answer is changed by the fault's rewrite
function, which sees the request body (with ``_seen``: how many times this proxy had been sent
the same body before) and how many chat requests this proxy has served. Upstream answers are
cached by request body (T=0 answers of one server are deterministic), so several proxies in one
test session ask the real server each distinct request once; a replayed answer carries no server
tok/s (it comes back at once, so the client's speed is not the server's).

Faults (FAULTS) are the failure shapes a broken deployment shows: acceptance collapsed to 1,
metrics that contradict themselves, acceptance decaying with every request, garbled text of
several classes, an early stop, chat-template tokens leaking (in the baseline too), think tags,
a verification bug that changes one word, and state carried from one request into the next.
The workload faults (WORKLOAD_FAULTS, run on WORKLOAD_MATRIX) break what a workload probe checks:
JSON and tool-call arguments cut short, reasoning left in the content, acceptance collapsing at
long context, prefix-cache hits lost with speculation, and a cache hit that changes the answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

Body = dict[str, Any]
_CACHE: dict[str, tuple[int, bytes]] = {}
_CACHE_LOCK = threading.Lock()


def _speculative(request: Body) -> bool:
    return (request.get("tree_budget") or 0) > 0


def _message(response: Body) -> dict[str, Any]:
    return response["choices"][0]["message"]


def _stats(response: Body) -> dict[str, Any]:
    return response.setdefault("ddtree", {})


def _set_acceptance(response: Body, mean: float) -> None:
    """Consistent numbers for a given mean acceptance (a server that really accepts that much)."""
    stats = _stats(response)
    tokens = response["usage"]["completion_tokens"]
    committed = max(1, tokens - 1)  # the first token comes from prefill
    rounds = max(1, round(committed / mean))
    base, extra = divmod(committed, rounds)
    lengths = [base + (1 if i < extra else 0) for i in range(rounds)]
    stats.update(decode_rounds=rounds, acceptance_lengths=lengths, mean_acceptance_length=sum(lengths) / rounds,
                 accepted_tokens=sum(n - 1 for n in lengths))


def collapse(request: Body, response: Body, n: int) -> None:
    """The draft's tokens are never accepted (draft not loaded, wrong wiring): acceptance 1."""
    if _speculative(request):
        _set_acceptance(response, 1.0)


def lying_metrics(request: Body, response: Body, n: int) -> None:
    """The server reports an acceptance its own rounds and tokens cannot give."""
    if _speculative(request):
        stats = _stats(response)
        stats["mean_acceptance_length"] = (stats.get("mean_acceptance_length") or 1.0) * 2.5 + 1


def decaying_acceptance(request: Body, response: Body, n: int) -> None:
    """Acceptance falls with every request the server has served (state leaking)."""
    if _speculative(request):
        mean = _stats(response).get("mean_acceptance_length") or 1.0
        _set_acceptance(response, max(1.0, mean * 0.8**n))


def _garble(make: Callable[[str], str]) -> Callable[[Body, Body, int], None]:
    def rewrite(request: Body, response: Body, n: int) -> None:
        if _speculative(request):
            message = _message(response)
            message["content"] = make(message["content"])

    rewrite.__doc__ = make.__doc__
    return rewrite


def _glued(text: str) -> str:
    """The answer's second word repeated with no separator."""
    words = text.split()
    return " ".join(words[:1]) + " " + (words[1].strip(".,!") if len(words) > 1 else "word") * 8


def _salad(text: str) -> str:
    """The answer's words cut at the wrong places and glued."""
    joined = "".join(text.split())
    pieces, at, step = [], 0, 2
    while at < len(joined):
        pieces.append(joined[at : at + step])
        at += step
        step = 2 + (step + 1) % 4  # 2, 5, 2, 5, ...: cuts that ignore the word boundaries
    return " ".join(pieces)


def _hollow(text: str) -> str:
    """The first line, then empty list items."""
    return text.split(".")[0] + ":\n" + "\n".join(["-"] * 8)


def _punct(text: str) -> str:
    """The answer, then one punctuation mark over and over."""
    return text + " " + "," * 30


def early_stop(request: Body, response: Body, n: int) -> None:
    """Stop after two words, mid-sentence (a stop id checked against unaccepted draft tokens)."""
    if _speculative(request):
        message = _message(response)
        message["content"] = " ".join(message["content"].split()[:2]).rstrip(".!?") + ","
        response["choices"][0]["finish_reason"] = "stop"
        response["usage"]["completion_tokens"] = 3
        _set_acceptance(response, 1.5)


def template_leak(request: Body, response: Body, n: int) -> None:
    """The end-of-turn token is not a stop token: the model writes the next turn (baseline too)."""
    message = _message(response)
    message["content"] += "<|im_end|>\n<|im_start|>user\nThanks!"


def think_leak(request: Body, response: Body, n: int) -> None:
    """Think tags in the answer although thinking is off."""
    if _speculative(request):
        message = _message(response)
        message["content"] = "<think>\nLet me answer.\n</think>\n\n" + message["content"]


def lossy(request: Body, response: Body, n: int) -> None:
    """A verification bug: one word differs from what the target alone says."""
    if _speculative(request):
        message = _message(response)
        words = message["content"].split(" ")
        at = len(words) // 2
        words[at] = "the" if words[at] != "the" else "a"
        message["content"] = " ".join(words)


_PREVIOUS: dict[int, str] = {}


def state_leak(request: Body, response: Body, n: int) -> None:
    """State carried between requests: from the second request on, the start of the previous
    answer comes back at the start of this one (a draft context / KV cache not reset)."""
    message = _message(response)
    original = message["content"]
    if n > 0 and _speculative(request):
        message["content"] = _PREVIOUS.get(id(state_leak), "")[:12] + original
    _PREVIOUS[id(state_leak)] = original


def healthy(request: Body, response: Body, n: int) -> None:
    """Pass-through."""


# Workload faults (WORKLOAD_MATRIX)

LONG_PROMPT_TOKENS = 400  # context-collapse: prompts longer than this lose their acceptance


def _thinking(request: Body) -> bool:
    kwargs = request.get("chat_template_kwargs") or {}
    return request.get("enable_thinking", kwargs.get("enable_thinking")) is True


def structured_broken(request: Body, response: Body, n: int) -> None:
    """A grammar not applied on the speculative path: the JSON answer stops before its end and
    tool-call arguments are not JSON (the closing brace never came)."""
    if not _speculative(request):
        return
    message = _message(response)
    for call in message.get("tool_calls") or []:
        call["function"]["arguments"] = call["function"]["arguments"].rstrip()[:-1]
    if request.get("response_format") and message.get("content"):
        content = message["content"].rstrip()
        message["content"] = content[: max(1, len(content) // 2)]


def reasoning_in_content(request: Body, response: Body, n: int) -> None:
    """Thinking on, with speculation: the reasoning parser is skipped, the thinking text comes back
    in think tags at the start of the content and there is no reasoning_content."""
    if _speculative(request) and _thinking(request):
        message = _message(response)
        reasoning = message.pop("reasoning_content", None) or "Let me think."
        message["content"] = f"<think>\n{reasoning}\n</think>\n\n" + (message.get("content") or "")


def context_collapse(request: Body, response: Body, n: int) -> None:
    """Short prompts keep their acceptance, long ones (more than LONG_PROMPT_TOKENS) drop to 1.0:
    the draft's positions or context features broken past some length."""
    if _speculative(request) and (response.get("usage") or {}).get("prompt_tokens", 0) > LONG_PROMPT_TOKENS:
        _set_acceptance(response, 1.0)


def _cached(response: Body, tokens: int) -> None:
    response["usage"].setdefault("prompt_tokens_details", {})["cached_tokens"] = tokens


def cache_lost(request: Body, response: Body, n: int) -> None:
    """A server with a prefix cache (the reference server has none: it is planted) that loses it
    with speculation: without it a repeated body is served from the cache, with it never."""
    repeat = request.get("_seen", 0) > 0
    _cached(response, 0 if _speculative(request) or not repeat else response["usage"]["prompt_tokens"])


def cache_changes_output(request: Body, response: Body, n: int) -> None:
    """A prefix-cache hit that leaks state: with speculation, a body sent before answers with one
    word changed."""
    if _speculative(request) and request.get("_seen", 0) > 0:
        message = _message(response)
        words = (message.get("content") or "").split(" ")
        at = len(words) // 2
        words[at] = "the" if words[at] != "the" else "a"
        message["content"] = " ".join(words)


FAULTS: dict[str, Callable[[Body, Body, int], None]] = {
    "healthy": healthy,
    "collapse": collapse,
    "lying-metrics": lying_metrics,
    "decaying-acceptance": decaying_acceptance,
    "glued-repeat": _garble(_glued),
    "salad": _garble(_salad),
    "hollow-list": _garble(_hollow),
    "punct-run": _garble(_punct),
    "early-stop": early_stop,
    "template-leak": template_leak,
    "think-leak": think_leak,
    "lossy": lossy,
    "state-leak": state_leak,
    "structured-broken": structured_broken,
    "reasoning-in-content": reasoning_in_content,
    "context-collapse": context_collapse,
    "cache-lost": cache_lost,
    "cache-changes-output": cache_changes_output,
}
WORKLOAD_FAULTS = ["healthy", "structured-broken", "reasoning-in-content", "context-collapse", "cache-lost",
                   "cache-changes-output"]
GATE_FAULTS = [f for f in FAULTS if f == "healthy" or f not in WORKLOAD_FAULTS]


class FaultProxy:
    def __init__(self, upstream: str, fault: str, headers: dict[str, str] | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.rewrite = FAULTS[fault]
        self.fault = fault
        self.headers = headers or {}
        self.served = 0
        self.seen: dict[str, int] = {}  # chat bodies: how many times each was sent
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                upstream = httpx.get(proxy.upstream + self.path, headers=proxy.headers, timeout=60)
                self._send(upstream.status_code, upstream.content, upstream.headers.get("content-type", "text/plain"))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = json.loads(raw)
                chat = self.path.split("?")[0].rstrip("/").endswith("/chat/completions")
                if chat:
                    request["stream"] = False  # the proxy rewrites whole bodies
                    request.pop("stream_options", None)
                status, content, replayed = proxy._upstream_post(self.path, request)
                if status != 200 or not chat:  # /tokenize and errors pass through
                    self._send(status, content, "application/json")
                    return
                response = json.loads(content)
                if replayed and isinstance(response.get("ddtree"), dict):
                    # A replay comes back at once: the server's decode speed of the first answer
                    # beside the client's speed of the replay would read as a speed mismatch.
                    response["ddtree"]["tokens_per_second"] = None
                key = json.dumps(request, sort_keys=True)
                with proxy._lock:
                    n = proxy.served
                    proxy.served += 1
                    request["_seen"] = proxy.seen.get(key, 0)
                    proxy.seen[key] = request["_seen"] + 1
                    proxy.rewrite(request, response, n)
                self._send(200, json.dumps(response).encode(), "application/json")

            def _send(self, status: int, content: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _upstream_post(self, path: str, request: Body) -> tuple[int, bytes, bool]:
        """(status, body, whether it is a replay from the cache)."""
        key = path + json.dumps(request, sort_keys=True)
        with _CACHE_LOCK:
            if key in _CACHE:
                return (*_CACHE[key], True)
        answer = httpx.post(self.upstream + path, json=request, headers=self.headers, timeout=300)
        result = (answer.status_code, answer.content)
        if answer.status_code == 200:
            with _CACHE_LOCK:
                _CACHE[key] = result
        return (*result, False)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


# ---------------------------------------------------------------------------------------------
# The gate suite: `ddtree-diag serve` (embedded SmolLM2 + its draft), a proxy per fault, the gate.

GATE_MATRIX = """
[defaults]
max_tokens = 40
temperature = 0.0
repeat = 2

[axes]
enable_thinking = [false]
tree_budget = [16, 48]

[prompts.hello]
text = "Say hello in one short sentence."

[prompts.capital]
text = "What is the capital of France? Answer in one sentence."

[baseline]
mode = "budget0"

[gate]
max_failed = 0
max_garbage = 0
lossless = true
min_completion_tokens = 2
fail_on_findings = "error"
"""

# What must name each fault: finding ids, or a failing gate check and a word its detail holds.
EXPECTED: dict[str, list[str]] = {
    "healthy": [],
    "collapse": ["finding:acceptance-collapse"],
    "lying-metrics": ["finding:metrics-contradict"],
    "decaying-acceptance": ["finding:acceptance-decays-over-run", "check:canary:acceptance fell"],
    "glued-repeat": ["check:max_garbage:glued_repeat"],
    "salad": ["check:max_garbage:word_salad"],
    "hollow-list": ["check:max_garbage:empty_list"],
    "punct-run": ["check:max_garbage:punct_run"],
    "early-stop": ["finding:early-stop"],
    "template-leak": ["check:max_garbage:template_leak", "finding:garbage-also-in-baseline:chat-template tokens"],
    "think-leak": ["check:max_garbage:thinking_leak"],
    "lossy": ["finding:lossless-mismatch", "check:lossless"],
    "state-leak": ["finding:canary-differs", "check:canary:text differs"],
}


# The workload suite: the same serve, WORKLOAD_MATRIX, a proxy per workload fault. Small for a CPU:
# one budget, one repeat, thinking off but for one prompt, short answers (the schema and the tool's
# arguments are bounded so SmolLM2 closes them), a 600-token fill (serve's CPU context is 4096).
# `capital` is GATE_MATRIX's (same body: the upstream cache answers it) and keeps the short
# prompts' acceptance well above context-collapse's 1.0. fail_on_findings = "warning": the healthy
# run has no finding at all, so each workload fault, warnings included, must fail the gate too.
WORKLOAD_MATRIX = """
[defaults]
max_tokens = 40
temperature = 0.0
repeat = 1

[axes]
enable_thinking = [false]
tree_budget = [16]

[prompts.capital]
text = "What is the capital of France? Answer in one sentence."

[prompts.city]
text = "Give the capital of France as JSON."
[prompts.city.json_schema]
type = "object"
required = ["city", "founded"]
additionalProperties = false
[prompts.city.json_schema.properties]
city = { type = "string", maxLength = 24 }
founded = { type = "integer", minimum = 0, maximum = 2000 }

[prompts.weather]
text = "What is the weather in Paris right now?"
tool_choice = "required"
[[prompts.weather.tools]]
name = "get_weather"
description = "Current weather in a city"
[prompts.weather.tools.parameters]
type = "object"
required = ["city"]
additionalProperties = false
properties = { city = { type = "string", maxLength = 24 } }

[prompts.think]
text = "How much do 12 pens cost at 3 pens for 2 euros?"
enable_thinking = [true]

[prompts.recall]
text = "In one sentence: what is the document above about?"
fill_tokens = [0, 600]

[prompts.cache]
text = "Name one place the document above mentions."
fill_tokens = [600]
prefix_cache = true

[baseline]
mode = "budget0"

[gate]
max_failed = 0
max_garbage = 0
lossless = true
min_completion_tokens = 2
fail_on_findings = "warning"
"""

WORKLOAD_EXPECTED: dict[str, list[str]] = {
    "healthy": [],
    "structured-broken": ["finding:structured-output-broken@error:city", "finding:structured-output-broken:weather",
                          "check:lossless"],
    "reasoning-in-content": ["finding:reasoning-in-content@error:</think> in the content"],
    "context-collapse": ["finding:acceptance-falls-with-context@warning:ctx=600",
                         "check:findings:Acceptance collapses at long context"],
    "cache-lost": ["finding:prefix-cache-lost-with-speculation@warning:cache=repeat",
                   "check:findings:Speculation turns prefix-cache hits off"],
    "cache-changes-output": ["finding:prefix-cache-changes-output@error:cache=repeat", "check:lossless"],
}
EXPECTED.update({fault: names for fault, names in WORKLOAD_EXPECTED.items() if fault != "healthy"})
# (matrix, faults) of each suite
SUITES: dict[str, tuple[str, list[str]]] = {"gate": (GATE_MATRIX, GATE_FAULTS),
                                            "workloads": (WORKLOAD_MATRIX, WORKLOAD_FAULTS)}


def named(report: Any, expectation: str) -> bool:
    """``finding:ID[@SEVERITY][:WORD]`` (WORD in its title, evidence or cases) or
    ``check:NAME[:WORD]`` (a failing gate check, WORD in its detail)."""
    kind, name, *word = expectation.split(":", 2)
    if kind == "finding":
        name, _, severity = name.partition("@")
        return any(f.id == name and (not severity or f.severity == severity)
                   and (not word or word[0] in f.title + f.evidence + " ".join(f.cases)) for f in report.findings)
    return any(c.name == name and not c.passed and (not word or word[0] in c.detail) for c in report.gate.checks)


def workload_findings(report: Any) -> list[str]:
    """The ids of the workload findings in ``report``."""
    from ddtree_diag.checks.workloads import WORKLOAD_RULES

    ids = {kind.id for rule in WORKLOAD_RULES for kind in rule.kinds}
    return sorted(f.id for f in report.findings if f.id in ids)


def start_serve(timeout: float = 300):
    """`ddtree-diag serve` on the embedded model (fp32 on CPU: greedy decoding is exact)."""
    from tests.support.processes import launch_serve

    return launch_serve("--device", "cpu", "--dtype", "fp32", timeout=timeout)


def run_fault(upstream: str, fault: str, workdir: Any, suite: str = "gate") -> tuple[int, Any, str]:
    """The gate (SUITES[suite]'s matrix) through a proxy planting ``fault``: (exit code, report,
    stdout)."""
    from ddtree_diag.records import RunReport
    from tests.support.processes import run_cli

    matrix = workdir / f"{suite}-faults.toml"
    matrix.write_text(SUITES[suite][0])
    out = workdir / f"{suite}-{fault}.json"
    proxy = FaultProxy(upstream, fault).start()
    try:
        result = run_cli("gate", str(matrix), "--url", proxy.url, "--no-stream", "--json", str(out), timeout=600)
    finally:
        proxy.stop()
    if not out.exists():
        raise RuntimeError(result.stderr)
    return result.code, RunReport.from_dict(json.loads(out.read_text())), result.stdout


def main() -> None:
    """Print the fault table of each suite: python -m tests.support.fault_proxy"""
    import tempfile
    import time
    from pathlib import Path

    from tests.support.processes import stop_serve

    process, url = start_serve()
    try:
        work = Path(tempfile.mkdtemp())
        for suite, (_, faults) in SUITES.items():
            print(f"\n{suite} suite\n{'fault':22} {'exit':>4}  {'caught':6}  named by")
            for fault in faults:
                start = time.time()
                code, report, _ = run_fault(url, fault, work, suite)
                ok = all(named(report, e) for e in EXPECTED[fault])
                caught = (code == 0 and not workload_findings(report)) if fault == "healthy" else (code == 1 and ok)
                names = sorted({f"{f.id} ({f.severity})" for f in report.findings}
                               | {c.name for c in report.gate.checks if not c.passed})
                print(f"{fault:22} {code:>4}  {'yes' if caught else 'NO':6}  {', '.join(names) or '-'}"
                      f"  ({time.time() - start:.1f} s)", flush=True)
    finally:
        stop_serve(process)


if __name__ == "__main__":
    main()
