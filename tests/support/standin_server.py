"""STAND-IN server for parser tests — not a real vLLM/SGLang/llama.cpp.

It replays the response shapes each server documents (see shared/DESIGN.md, "Server dialects")
so the probe's request shaping, streaming and parsing can be tested over real HTTP on loopback
for servers we cannot run here. Behaviour is chosen per process (``--dialect``) and per request
(a prompt containing ``FAIL:<mode>`` triggers an error path or an unusual shape).

Fault flags (``--lossy``, ``--flaky-text``, ``--tie-gap``, ``--rounds-mismatch``, ``--acceptance-decay``,
``--thinking-garbage``, ``--thinking-low-acceptance``, ``--early-stop``, ``--loop``, ``--inverse-budget``,
``--server-tps``, ``--seconds-per-token``) each make one kind of problem real, so the gate, the
lossless check and the findings are tested against a server that really has it.

Workloads (OpenAI shapes): ``response_format`` json_object / json_schema is answered with valid JSON
(a minimal instance of the schema), ``tools`` (tool_choice auto, required or named) with
``tool_calls`` (streamed as ``delta.tool_calls`` pieces by index); ``usage.prompt_tokens`` counts
the prompt's words (plus a few template tokens a message), ``POST /tokenize`` (vllm and ddtree
dialects, vLLM's shape) counts the same way, ``/v1/models`` lists ``max_model_len``; a prompt seen
before is a prefix-cache hit (``usage.prompt_tokens_details.cached_tokens``; llamacpp:
``timings.cache_n``). ``--reasoning`` separates reasoning (``reasoning_content``) in every
dialect (vllm and sglang always do). Workload faults, each "with speculation" meaning a tree
budget other than 0 (always, for dialects without a per-request budget: their baseline is a
second stand-in without the flag): ``--structured-broken`` (JSON cut, tool arguments not JSON),
``--no-enforce`` (JSON in a Markdown fence, tool calls as markup in the content, with or without
speculation), ``--reasoning-in-content`` (``<think>…</think>answer`` in the content),
``--context-collapse`` (acceptance 1.0 past LONG_PROMPT_WORDS words), ``--cache-lost`` (no cache
hit), ``--cache-changes-output`` (a cache hit answers CACHED_ANSWER, with or without speculation).

Speed: with speculation a request "decodes" at ``--seconds-per-token`` a token; without it (tree
budget 0) AR_SLOWDOWN times slower, so a healthy stand-in's speed-up is about 3 at any load (the
requests sleep, so concurrency costs nothing). Load faults: ``--slow-spec-under-load N`` (with
speculation, every token takes UNDER_LOAD_SLOWDOWN times the autoregressive time while more than N
requests are in flight: faster alone, slower under load) and ``--no-drafts`` (speculation drafts
nothing: 0 draft tokens where the dialect reports them, one token per round, autoregressive speed).
``--ignore-budget``: the per-request budget is read by nothing (as current llama.cpp servers drop
``speculative.n_max``): every request speculates, budget 0 included.

Per-round numbers: a healthy run's rounds commit 1-5 tokens (SMOOTH_ROUNDS: acceptance decays smoothly
with depth), told as vLLM's ``acceptance_histogram`` (with ``num_spec_tokens``), SGLang's
``spec_correct_drafts_histogram`` and the ``/metrics`` per-position counters (vllm, llamacpp).
``--capped-depth K``: with speculation, every round accepts exactly K draft tokens (K + 1 committed;
the last round what is left), although drafts are SPEC_TOKENS long; the ddtree dialect then also
lists the rounds (``acceptance_lengths``).

Run: python tests/support/standin_server.py --dialect vllm --port 0   (prints "PORT <n>" when ready)
Fleets: ``--replicas N`` serves N identical replicas (one shared State, so ``/_requests`` lists
every replica's requests) from one process on N loopback ports, and prints "PORTS p1 ... pN".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = "Hello! It is nice to meet you."
# What a lossy speculative server says instead (differs from ANSWER at token 3, "nice " -> "good ").
LOSSY_ANSWER = "Hello! It is good to meet you."
# The story's thinking-on output (shared/DESIGN.md): garbage from a broken server.
STORY_GARBAGE = "Thinking to the 1. 1. 题目:\nuser:\n# user: 1.\n# 1. 1. 1. 年 1 1. 三角形\n1."
REASONING = "The user wants a greeting."
# What a prefix-cache hit says under --cache-changes-output (state leaking through the cache).
CACHED_ANSWER = "Hello again! It is nice to see you."
OTHER_CHOICE = "Bonjour mes amis"  # FAIL:n2's second choice
LONG_PROMPT_WORDS = 1000  # --context-collapse: acceptance collapses past this many prompt words
# A chat template's tokens around each message and the assistant's opening (usage and /tokenize).
TEMPLATE_TOKENS_PER_MESSAGE = 3
TEMPLATE_TOKENS_REPLY = 3
MAX_MODEL_LEN = 32768
BUDGET_DIALECTS = ("ddtree", "ddtree-mlx", "llamacpp")  # a per-request budget; 0 = no speculation
SECONDS_PER_TOKEN = 0.002  # the stand-in "decodes" at ~500 tok/s, and reports what it measured
AR_SLOWDOWN = 3.0  # tree budget 0 commits one token per round, speculation ~3: per token, 3× slower
UNDER_LOAD_SLOWDOWN = 3.0  # --slow-spec-under-load: a speculative token then takes 3× an AR token
SPEC_TOKENS = 4  # draft tokens per round (vLLM num_spec_tokens): --capped-depth K < 4 caps below it
# Tokens committed per round by a healthy draft, cycled: mean 3; depth 1..4 accepted in 90/70/40/10 %.
SMOOTH_ROUNDS = (3, 2, 4, 3, 1, 5, 2, 3, 4, 3)


class State:
    dialect = "openai"
    per_request_metrics = True  # vLLM: --per-request-spec-decode-metrics
    metrics_endpoint = True
    strict = False  # reject unknown fields with 400, like the real OpenAI API
    any_model = False  # answer any model name (llama.cpp, SGLang); else 404 for unlisted ones
    drafts = 0
    draft_tokens = 0
    accepted = 0
    requests: list[dict] = []  # noqa: RUF012 - process-wide log, by design
    lock = threading.Lock()
    # Fault modes for the checks (lossless, findings, gate); all off = a healthy server.
    answer = ANSWER
    lossy = False  # answer differently whenever tree_budget != 0 (speculation changes the text)
    flaky_text = False  # alternate answers between requests (T=0 repeats disagree)
    tie_gap = 2.5  # logprob gap between the top-2 tokens where the lossy answer diverges
    rounds_mismatch = False  # report decode_rounds that do not add up to the completion tokens
    acceptance_decay = False  # acceptance falls with every request (state leaking)
    thinking_garbage = False  # thinking on -> the story's garbage
    thinking_low_acceptance = False  # thinking on -> acceptance 1.0
    early_stop = False  # thinking off -> "Hello," then stop
    loop = False  # a token loop to max_tokens with very high acceptance
    inverse_budget = False  # acceptance falls as the tree budget grows
    server_tps: float | None = None  # report this tok/s instead of the measured one
    seconds_per_token = SECONDS_PER_TOKEN  # a slow server: decode takes this long per token
    first_token_delay = 0.0  # a slow prefill: this long before anything is sent
    seen: dict[str, int] = {}  # noqa: RUF012 - times each request body was seen
    # Workloads
    max_model_len = MAX_MODEL_LEN
    reasoning = False  # separate reasoning (reasoning_content) in every dialect, not only vllm/sglang
    structured_broken = False  # with speculation: JSON cut short, tool-call arguments not JSON
    no_enforce = False  # JSON in a Markdown fence, tool calls as markup in the content (always)
    reasoning_in_content = False  # thinking on, with speculation: <think>…</think> in the content
    context_collapse = False  # with speculation: acceptance 1.0 past LONG_PROMPT_WORDS prompt words
    cache_lost = False  # with speculation: no prefix-cache hit
    cache_changes_output = False  # a prefix-cache hit answers CACHED_ANSWER
    # Load (the speed-up sweep)
    slow_spec_under_load: int | None = None  # with speculation, slow while more requests are in flight
    no_drafts = False  # speculation drafts nothing: acceptance 1, 0 draft tokens, AR speed
    ignore_budget = False  # the per-request budget is read by nothing: every request speculates
    in_flight = 0  # chat requests being answered now
    capped_depth: int | None = None  # with speculation, every round accepts exactly this many drafts
    accepted_per_pos: list[int] = []  # noqa: RUF012 - /metrics per-position counters (position 0 = depth 1)
    cache_seen: set[str] = set()  # noqa: RUF012 - prompts in the "prefix cache"
    tokenize_requests: list[dict] = []  # noqa: RUF012 - what /tokenize was asked


def token_seconds(body: dict) -> float:
    """How long this request takes per token now: speculation is AR_SLOWDOWN times faster than
    budget 0 (and than itself under --no-drafts), except under --slow-spec-under-load with more
    requests in flight than allowed, where it is UNDER_LOAD_SLOWDOWN times slower than budget 0."""
    autoregressive = State.seconds_per_token * AR_SLOWDOWN
    if not speculating(body) or State.no_drafts:
        return autoregressive
    limit = State.slow_spec_under_load
    if limit is not None and State.in_flight > limit:
        return autoregressive * UNDER_LOAD_SLOWDOWN
    return State.seconds_per_token


def budget_of(body: dict):
    """The per-request budget a dialect sends: tree_budget, or llama.cpp's speculative.n_max."""
    return body["tree_budget"] if "tree_budget" in body else body.get("speculative.n_max")


def speculating(body: dict) -> bool:
    """Whether this request is decoded with speculation: a budget other than 0 where the dialect
    takes one per request; always where it does not (its baseline is another process)."""
    return State.dialect not in BUDGET_DIALECTS or budget_of(body) != 0 or State.ignore_budget


def content_text(content) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def prompt_words(messages) -> int:
    return sum(len(content_text(m.get("content")).split()) for m in messages or [] if isinstance(m, dict))


def prompt_count(messages) -> int:
    """The prompt's 'tokens': its words plus the template's (12 for one short user message)."""
    messages = [m for m in messages or [] if isinstance(m, dict)]
    return prompt_words(messages) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_REPLY


def instance_of(schema, depth: int = 0):
    """A minimal instance valid against a (simple) JSON Schema: enum/const first, then by type."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance_of(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        properties = schema.get("properties") or {}
        value = {name: instance_of(sub, depth + 1) for name, sub in properties.items()}
        for name in schema.get("required") or []:
            value.setdefault(name, "text")
        return value
    if kind == "array":
        count = 0 if schema.get("maxItems") == 0 else max(1, schema.get("minItems", 0))
        return [instance_of(schema.get("items") or {"type": "string"}, depth + 1) for _ in range(count)]
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1 if "exclusiveMinimum" in schema else 1)
        value = min(low, schema.get("maximum", low))
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = "text" * max(1, -(-schema.get("minLength", 0) // 4))
    return text[: schema.get("maxLength", len(text))]


def structured_answer(body: dict, text: str) -> tuple[str | None, dict | None]:
    """(content, tool call) for a request with tools or a JSON response_format; (text, None)
    otherwise. The faults break them here."""
    tools = [t.get("function", t) for t in body.get("tools") or [] if isinstance(t, dict)]
    choice = body.get("tool_choice")
    if tools and choice != "none":
        named = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        tool = next((t for t in tools if t.get("name") == named), tools[0])
        arguments = json.dumps(instance_of(tool.get("parameters") or {"type": "object"}))
        if State.no_enforce:  # the model's own markup, no tool parser
            call = json.dumps({"name": tool.get("name"), "arguments": json.loads(arguments)})
            return f"<tool_call>\n{call}\n</tool_call>", None
        if State.structured_broken and speculating(body):
            arguments = arguments[:-1]  # the closing brace never came
        return None, {"name": tool.get("name"), "arguments": arguments}
    fmt = body.get("response_format") or {}
    if fmt.get("type") not in ("json_object", "json_schema"):
        return text, None
    if fmt["type"] == "json_schema":
        value = instance_of((fmt.get("json_schema") or {}).get("schema") or {"type": "object"})
    else:
        value = {"answer": text}
    answer = json.dumps(value)
    if State.no_enforce:
        return f"```json\n{answer}\n```", None
    if State.structured_broken and speculating(body):
        return answer[:-1], None  # cut before the closing brace
    return answer, None


def tokens_of(text: str) -> list[str]:
    """Whitespace-ish 'tokens' so usage counts are consistent with the text."""
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]


def round_lengths(n: int, rounds: int) -> list[int] | None:
    """Tokens committed per round, summing to ``n``: ``--capped-depth K`` rounds of K + 1 (the last
    one what is left), else SMOOTH_ROUNDS evened out to the total. None when rounds > n."""
    if rounds > n or rounds < 1:
        return None
    cap = State.capped_depth
    if cap is not None and rounds == -(-n // (cap + 1)):
        full, rest = divmod(n, cap + 1)
        return [cap + 1] * full + ([rest] if rest else [])
    lengths = [SMOOTH_ROUNDS[i % len(SMOOTH_ROUNDS)] for i in range(rounds)]
    step = 0
    while sum(lengths) != n:  # one token off or onto each round in turn: the curve keeps its shape
        i = step % rounds
        if sum(lengths) > n and lengths[i] > 1:
            lengths[i] -= 1
        elif sum(lengths) < n:
            lengths[i] += 1
        step += 1
    return lengths


def spec_numbers(completion_tokens: int, rounds: int | None = None, drafting: bool = True) -> dict:
    # A plausible speculative run: rounds of up to 3 committed tokens (accepted drafts + bonus).
    # Not drafting (budget 0 where the budget is read): rounds of one token, nothing drafted.
    if rounds is None:
        rounds = max(1, -(-completion_tokens // 3))
    accepted = completion_tokens - rounds
    drafts = rounds * SPEC_TOKENS if drafting and not State.no_drafts else 0
    lengths = round_lengths(completion_tokens, rounds)
    with State.lock:
        State.drafts += rounds if drafting else 0
        State.draft_tokens += drafts
        State.accepted += accepted
        for length in lengths or []:
            for position in range(length - 1):
                if position >= len(State.accepted_per_pos):
                    State.accepted_per_pos.append(0)
                State.accepted_per_pos[position] += 1
    return {"rounds": rounds, "accepted": accepted, "drafts": drafts, "mean": completion_tokens / rounds,
            "lengths": lengths}


def histogram_of(lengths: list[int] | None, size: int = 0) -> list[int] | None:
    """Rounds per accepted-draft count (index j: rounds that accepted j drafts), at least ``size`` long."""
    if not lengths:
        return None
    counts = [0] * max(size, max(lengths))
    for length in lengths:
        counts[length - 1] += 1
    return counts


def rounds_for(n: int, body: dict, thinking) -> int | None:
    """Round counts for the fault modes (None = the default plausible run)."""
    if n <= 1:
        return None
    budget = budget_of(body)
    if (budget == 0 and not State.ignore_budget) or State.no_drafts:
        return n  # plain autoregressive: one token per round
    if State.capped_depth is not None:
        return -(-n // (State.capped_depth + 1))  # no round accepts more than K drafts
    if State.context_collapse and prompt_words(body.get("messages")) > LONG_PROMPT_WORDS:
        return n  # the draft helps nothing at long context
    if State.loop:
        return max(1, -(-n // 8))
    if thinking and State.thinking_garbage:
        return max(1, round(n / 2.23))
    if thinking and State.thinking_low_acceptance:
        return n
    if State.acceptance_decay:
        # State leaking between requests: each time the same request comes back, acceptance is
        # lower (as if a stale draft context were reused).
        key = json.dumps([body.get("messages"), thinking, budget], sort_keys=True)
        with State.lock:
            seen = State.seen[key] = State.seen.get(key, -1) + 1
        return min(n, max(1, -(-n // 3)) + 2 * seen)
    if State.inverse_budget and isinstance(budget, int):
        return min(n, max(1, budget // 8))
    return None


def extras_for(dialect: str, n: int, body: dict, thinking=None, tps: float | None = None, *,
               prompt_n: int = 12, cached: int = 0) -> dict:
    spec = spec_numbers(n, rounds_for(n, body, thinking), drafting=speculating(body))
    tps = State.server_tps if State.server_tps is not None else tps
    if dialect == "ddtree":
        rounds = n if State.rounds_mismatch else spec["rounds"]
        stats = {"decode_rounds": rounds, "mean_acceptance_length": spec["mean"],
                 "tokens_per_second": tps, "tree_budget": body.get("tree_budget", 64)}
        if spec["lengths"] and State.capped_depth is not None:  # healthy: no per-round numbers, as before
            stats["acceptance_lengths"] = spec["lengths"]
        if State.no_drafts:
            stats["draft_tokens"] = 0
        return {"ddtree": stats}
    if dialect == "ddtree-mlx":
        return {"ddtree_stats": {"tree_budget": body.get("tree_budget", 64), "cycles": spec["rounds"],
                                 "avg_acceptance": spec["mean"], "tok_per_sec": tps}}
    if dialect == "vllm":
        if not State.per_request_metrics:
            return {"metrics": None}
        return {"metrics": {"speculative_decoding": {
            "mean_acceptance_length": spec["mean"], "num_spec_steps": spec["rounds"],
            "num_draft_tokens": spec["drafts"], "num_accepted_draft_tokens": spec["accepted"],
            "num_spec_tokens": SPEC_TOKENS, "acceptance_histogram": histogram_of(spec["lengths"], SPEC_TOKENS + 1)}}}
    if dialect == "sglang":
        if not body.get("return_spec_tokens_details"):
            return {}
        return {"sglext": {"spec_tokens_details": {
            "spec_accept_length": spec["mean"], "spec_accept_rate": 0.5,
            "spec_verify_ct": spec["rounds"], "spec_num_correct_drafts": spec["accepted"],
            "spec_num_proposed_drafts": spec["drafts"],
            "spec_correct_drafts_histogram": histogram_of(spec["lengths"])}}}
    if dialect == "llamacpp":
        return {"timings": {"prompt_n": prompt_n - cached, "cache_n": cached, "prompt_ms": 5.0,
                            "predicted_n": n, "predicted_ms": 100.0, "predicted_per_second": tps,
                            "draft_n": spec["drafts"], "draft_n_accepted": spec["accepted"]}}
    return {}


def answer_for(body: dict, thinking) -> str:
    if thinking and State.thinking_garbage:
        return STORY_GARBAGE
    if not thinking and State.early_stop:
        return "Hello,"
    if State.lossy and body.get("tree_budget") != 0:
        return LOSSY_ANSWER
    if State.flaky_text:
        with State.lock:
            count = sum(1 for r in State.requests if int(r.get("max_tokens") or 0) > 1)
        return LOSSY_ANSWER if count % 2 == 0 else State.answer
    return State.answer


def logprobs_for(toks: list[str], text: str) -> list[dict]:
    """OpenAI-shaped per-token logprobs. Where ANSWER and LOSSY_ANSWER part ways the top two
    candidates are those two tokens, ``State.tie_gap`` nats apart."""
    other = tokens_of(LOSSY_ANSWER if text == ANSWER else ANSWER)
    entries = []
    for i, tok in enumerate(toks):
        if i < len(other) and other[i] != tok and text in (ANSWER, LOSSY_ANSWER):
            top, alt, alt_lp = -0.6, other[i], -0.6 - State.tie_gap
        else:
            top, alt, alt_lp = -0.05, " the", -4.0
        entries.append({"token": tok, "logprob": top, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": tok, "logprob": top}, {"token": alt, "logprob": alt_lp}]})
    return entries


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls on small writes

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _json(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            owner = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}.get(State.dialect, "standin")
            entry = {"id": "standin-model", "object": "model", "owned_by": owner}
            if State.dialect in ("vllm", "sglang", "ddtree"):
                entry["max_model_len"] = State.max_model_len
            self._json(200, {"object": "list", "data": [entry]})
        elif self.path == "/props" and State.dialect == "llamacpp":
            self._json(200, {"default_generation_settings": {"n_ctx": State.max_model_len}})
        elif self.path == "/_requests":  # test hook: what the probe sent
            with State.lock:
                self._json(200, State.requests)
        elif self.path == "/_tokenize":  # test hook: what /tokenize was asked
            with State.lock:
                self._json(200, State.tokenize_requests)
        elif self.path == "/metrics" and State.metrics_endpoint and State.dialect in ("vllm", "llamacpp"):
            prefix = "vllm:" if State.dialect == "vllm" else "llamacpp:"
            lines = []
            for name, value in (("spec_decode_num_drafts", State.drafts),
                                ("spec_decode_num_draft_tokens", State.draft_tokens),
                                ("spec_decode_num_accepted_tokens", State.accepted)):
                lines.append(f"# HELP {prefix}{name} stand-in counter")
                lines.append(f"# TYPE {prefix}{name} counter")
                # two engines, as vLLM exposes one series per engine: the probe must sum them
                half = value // 2
                lines.append(f'{prefix}{name}_total{{engine="0",model_name="m"}} {half}')
                lines.append(f'{prefix}{name}_total{{engine="1",model_name="m"}} {value - half}')
                lines.append(f'{prefix}{name}_created{{engine="0",model_name="m"}} 1.7e9')
            # accepted per draft position, every position a draft has (position 0 = depth 1)
            with State.lock:
                per_pos = State.accepted_per_pos + [0] * (SPEC_TOKENS - len(State.accepted_per_pos))
            name = "spec_decode_num_accepted_tokens_per_pos"
            lines += [f"# HELP {prefix}{name} stand-in counter", f"# TYPE {prefix}{name} counter"]
            for position, value in enumerate(per_pos):
                half = value // 2
                lines.append(f'{prefix}{name}_total{{engine="0",model_name="m",position="{position}"}} {half}')
                lines.append(f'{prefix}{name}_total{{engine="1",model_name="m",position="{position}"}} {value - half}')
            data = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found"}})

    def _tokenize(self, body: dict) -> None:
        """vLLM's /tokenize: a chat (``messages``, the template's tokens counted like usage's) or a
        text (``prompt``) -> {"count", "max_model_len", "tokens"}."""
        with State.lock:
            State.tokenize_requests.append(body)
        if isinstance(body.get("messages"), list):
            count = prompt_count(body["messages"])
        elif isinstance(body.get("prompt"), str):
            count = len(body["prompt"].split())
        else:
            self._json(400, {"error": {"message": "messages or prompt required", "type": "BadRequestError"}})
            return
        self._json(200, {"count": count, "max_model_len": State.max_model_len, "tokens": list(range(count))})

    def do_POST(self) -> None:
        with State.lock:  # --slow-spec-under-load reads how many requests are being answered
            State.in_flight += 1
        try:
            self._post()
        finally:
            with State.lock:
                State.in_flight -= 1

    def _post(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
            return
        if self.path == "/tokenize" and State.dialect in ("vllm", "ddtree"):
            self._tokenize(body)
            return
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": "not found"}})
            return
        with State.lock:
            State.requests.append(body)
        if not State.any_model and body.get("model") not in ("standin-model", None):
            # as vLLM and OpenAI do; llama.cpp and SGLang answer any name (--any-model)
            self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                       "type": "NotFoundError"}})
            return
        if State.strict:
            known = {"model", "messages", "max_tokens", "temperature", "stream", "response_format", "tools",
                     "tool_choice"}
            unknown = sorted(set(body) - known)
            if unknown:
                self._json(400, {"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                           "type": "invalid_request_error"}})
                return
        prompt = " ".join(m.get("content", "") for m in body.get("messages", []))
        if "FAIL:500" in prompt:
            self._json(500, {"error": {"message": "CUDA error: an illegal memory access", "type": "server_error"}})
            return
        if "FAIL:nonjson" in prompt:
            data = b"<html>Bad Gateway</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if "FAIL:nochoices" in prompt:
            self._json(200, {"id": "x", "object": "chat.completion", "choices": []})
            return
        if "FAIL:slow" in prompt:
            time.sleep(3)
        time.sleep(State.first_token_delay)
        thinking = body.get("enable_thinking")
        if thinking is None:
            kwargs = body.get("chat_template_kwargs") or body.get("chat_template_args") or {}
            thinking = kwargs.get("enable_thinking")
        separated = State.dialect in ("vllm", "sglang") or State.reasoning or State.reasoning_in_content
        reasoning = REASONING if thinking and separated else None
        max_tokens = int(body.get("max_tokens") or 16)
        # The prefix cache: a prompt (with its thinking mode) seen before is served from it.
        messages = body.get("messages")
        prompt_n = prompt_count(messages)
        key = json.dumps([messages, thinking], sort_keys=True)
        with State.lock:
            hit = key in State.cache_seen
            State.cache_seen.add(key)
        cached = prompt_n if hit and not (State.cache_lost and speculating(body)) else 0
        text = answer_for(body, thinking)
        if hit and State.cache_changes_output:
            text = CACHED_ANSWER
        text, call = structured_answer(body, text)
        if call is not None:
            text = ""
            call["id"] = f"call_{zlib.crc32(key.encode()):08x}"
        elif thinking and State.reasoning_in_content and speculating(body):
            text = f"<think>{REASONING}</think>{text}"  # the reasoning parser skipped
            reasoning = None
        toks = tokens_of(call["arguments"] if call is not None else text)
        if State.loop and max_tokens > 1 and call is None:
            toks = ["the "] * max_tokens
        finish = "tool_calls" if call is not None else "stop"
        if len(toks) > max_tokens:
            toks = toks[:max_tokens]
            finish = "length" if call is None else finish
        if State.dialect == "ddtree-mlx":
            finish = "stop"  # it always says stop
        n = len(toks)
        started = time.perf_counter()
        for _ in range(n):  # "decode", so the server's tok/s is a real measurement
            time.sleep(token_seconds(body))
        tps = round(n / (time.perf_counter() - started), 1)
        extras = extras_for(State.dialect, n, body, thinking, tps, prompt_n=prompt_n, cached=cached)
        usage = {"prompt_tokens": prompt_n, "completion_tokens": n, "total_tokens": prompt_n + n}
        if State.dialect != "llamacpp":  # llama.cpp: timings.cache_n
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        logprobs = logprobs_for(toks, text) if body.get("logprobs") and call is None else None
        stream = body.get("stream") and State.dialect != "ddtree-mlx"  # ddtree-mlx ignores stream
        if not stream:
            message = {"role": "assistant", "content": "".join(toks) if call is None else None}
            if call is not None:
                message["tool_calls"] = [{"id": call["id"], "type": "function",
                                          "function": {"name": call["name"], "arguments": call["arguments"]}}]
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = {"content": logprobs}
            choices = [choice]
            if "FAIL:n2" in prompt:  # n = 2: a second choice, listed first
                choices.insert(0, {"index": 1, "message": {"role": "assistant", "content": OTHER_CHOICE},
                                   "finish_reason": "length"})
            payload = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "standin-model",
                       "choices": choices, "usage": usage}
            payload.update(extras)
            self._json(200, payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        close = State.dialect == "llamacpp"  # llama.cpp closes the connection after a stream
        self.send_header("Connection", "close" if close else "keep-alive")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send_raw(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def send(obj) -> None:
            send_raw(("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode())

        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "standin-model"}
        send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if reasoning:
            send({**base, "choices": [{"index": 0, "delta": {"reasoning_content": reasoning}}]})
        if call is not None:
            # OpenAI: the call's id, type and name first, then its arguments in pieces, by index
            send({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": ""}}]}}]})
            for tok in toks:
                send({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": tok}}]}}]})
                time.sleep(token_seconds(body))
            toks = []
        for i, tok in enumerate(toks):
            choice = {"index": 0, "delta": {"content": tok}}
            if logprobs is not None:
                choice["logprobs"] = {"content": [logprobs[i]]}
            if "FAIL:n2" in prompt:  # n = 2: the other choice's chunks interleaved, tagged index 1
                send({**base, "choices": [{"index": 1, "delta": {"content": OTHER_CHOICE.split()[i % 3] + " "}}]})
            send({**base, "choices": [choice]})
            time.sleep(token_seconds(body))
            if "FAIL:truncate" in prompt and i == 2:
                self.wfile.write(b"0\r\n\r\n")  # end the body without [DONE] or a finish chunk
                self.wfile.flush()
                self.close_connection = True
                return
            if "FAIL:llamaerror" in prompt and i == 2:
                # llama.cpp: a failure mid-stream is a line of its own ``error`` field, then [DONE]
                send_raw(b'error: {"code": 500, "message": "Input prompt is too big compared to KV size", '
                         b'"type": "server_error"}\n\n')
                send("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return
            if "FAIL:abort" in prompt and i == 2:
                finish = "abort"  # SGLang / vLLM: the request aborted on the server
                break
        final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        if State.dialect == "llamacpp":
            final.update(extras)  # timings ride the last chunk
        send(final)
        if State.dialect == "sglang" and extras:
            send({**base, "choices": [], **extras})  # its own chunk after the finish chunk
        if include_usage:
            usage_chunk = {**base, "choices": [], "usage": usage}
            if State.dialect in ("vllm", "ddtree"):
                usage_chunk.update(extras)  # vLLM: metrics only in the final usage chunk
            send(usage_chunk)
        elif State.dialect == "ddtree":
            send({**base, "choices": [], **extras})
        send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        if close:
            self.close_connection = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dialect", default="openai")
    parser.add_argument("--port", type=int, default=0)
    # N identical servers (one State) on N ports: prints "PORTS p1 ... pN" instead of "PORT p".
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--no-per-request-metrics", action="store_true")
    parser.add_argument("--no-metrics-endpoint", action="store_true")
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--any-model", action="store_true")
    # Fault modes (see State); each one makes exactly one kind of problem real.
    parser.add_argument("--answer", default=ANSWER)
    parser.add_argument("--lossy", action="store_true")
    parser.add_argument("--flaky-text", action="store_true")
    parser.add_argument("--tie-gap", type=float, default=2.5)
    parser.add_argument("--rounds-mismatch", action="store_true")
    parser.add_argument("--acceptance-decay", action="store_true")
    parser.add_argument("--thinking-garbage", action="store_true")
    parser.add_argument("--thinking-low-acceptance", action="store_true")
    parser.add_argument("--early-stop", action="store_true")
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--inverse-budget", action="store_true")
    parser.add_argument("--server-tps", type=float, default=None)
    parser.add_argument("--seconds-per-token", type=float, default=SECONDS_PER_TOKEN)
    parser.add_argument("--first-token-delay", type=float, default=0.0)  # a slow prefill, in seconds
    # Workloads (see the module docstring)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--reasoning", action="store_true")
    parser.add_argument("--structured-broken", action="store_true")
    parser.add_argument("--no-enforce", action="store_true")
    parser.add_argument("--reasoning-in-content", action="store_true")
    parser.add_argument("--context-collapse", action="store_true")
    parser.add_argument("--cache-lost", action="store_true")
    parser.add_argument("--cache-changes-output", action="store_true")
    parser.add_argument("--capped-depth", type=int, default=None)  # every round accepts exactly K drafts
    parser.add_argument("--slow-spec-under-load", type=int, default=None)  # N: slow beyond N requests in flight
    parser.add_argument("--no-drafts", action="store_true")
    parser.add_argument("--ignore-budget", action="store_true")
    args = parser.parse_args()
    for name in ("answer", "lossy", "flaky_text", "tie_gap", "rounds_mismatch", "acceptance_decay",
                 "thinking_garbage", "thinking_low_acceptance", "early_stop", "loop", "inverse_budget",
                 "server_tps", "seconds_per_token", "first_token_delay", "max_model_len", "reasoning",
                 "structured_broken", "no_enforce", "reasoning_in_content", "context_collapse", "cache_lost",
                 "cache_changes_output", "capped_depth", "slow_spec_under_load", "no_drafts", "ignore_budget"):
        setattr(State, name, getattr(args, name))
    State.dialect = args.dialect
    State.per_request_metrics = not args.no_per_request_metrics
    State.metrics_endpoint = not args.no_metrics_endpoint
    State.strict = args.strict
    State.any_model = args.any_model
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    if args.replicas == 1:
        server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
        print(f"PORT {server.server_address[1]}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
        return
    serve_replicas(args.replicas, args.port)


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft limit on open files towards ``wanted`` (at most the hard limit): each replica
    holds a listening socket, and every connection to it one more."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def serve_replicas(count: int, port: int) -> None:
    """``--replicas N``: N identical servers (one shared State) on N loopback ports, one daemon
    thread each; prints "PORTS p1 ... pN" once every one is listening. ``--port`` P > 0 asks for
    P..P+N-1; 0 (the default) for free ports. The process ending (a signal, Ctrl-C) stops them all."""
    raise_fd_limit(4 * count + 256)  # a listening socket and a few connections per replica
    servers = []
    try:
        for index in range(count):
            servers.append(ThreadingHTTPServer(("127.0.0.1", port + index if port else 0), Handler))
    except OSError as exc:
        print(f"ERROR cannot listen on replica {len(servers) + 1} of {count}: {exc}", flush=True)
        raise SystemExit(1) from None
    for server in servers:  # ThreadingHTTPServer's request threads are daemon threads too
        # Nothing ever calls shutdown(): a long poll keeps N idle accept loops from waking up.
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 3600}, daemon=True,
                         name=f"replica-{server.server_address[1]}").start()
    print("PORTS " + " ".join(str(s.server_address[1]) for s in servers), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
