"""Hypothesis strategies for server replies: what a broken, hostile or merely odd server may send.

Shapes follow the real ones (chat completions, stream chunks, each dialect's extra object,
/v1/models, Prometheus pages) and are mostly well formed, so the parsers go all the way down;
the junk concentrates in the leaves: wrong types, non-finite or absurd numbers, lone surrogates,
markup. A minority of bodies is then broken as bytes (truncated, invalid UTF-8, nested 100,000
deep, NaN literals, 5,000-digit integers, binary garbage).
"""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

# Numbers that break naive code: non-finite, huge, negative, tiny, booleans, numeric strings.
EVIL_NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 1e-320, -1, 0, 2**53 + 1, 2**64, -(2**63),
                10**300, 1e15, 1e16, True, False, "12", "1e999", "nan", "-5", "", None, [], {}, "abc"]
SPEC_KEYS = {
    "ddtree": ["decode_rounds", "mean_acceptance_length", "acceptance_lengths", "draft_tokens", "accepted_tokens",
               "tokens_per_second", "tree_budget", "rounds", "num_rounds", "mean_acceptance", "tok_per_sec"],
    "ddtree_stats": ["cycles", "avg_acceptance", "tok_per_sec", "tree_budget", "decode_rounds"],
    "speculative_decoding": ["mean_acceptance_length", "num_spec_steps", "num_draft_tokens",
                             "num_accepted_draft_tokens", "num_drafts", "num_accepted_tokens"],
    "spec_tokens_details": ["spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts", "spec_accepted_drafts",
                            "spec_accept_token_num", "spec_num_proposed_drafts", "spec_draft_token_num"],
    "timings": ["predicted_n", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted"],
}


# Pools: one draw gives a leaf (cheap on a slow box), and every pool holds values that break parsers.
ODD_TEXTS = ["", " ", "Hello! It is nice to meet you.", "Hello,", "the the the the the the", "[/]", "[bold]x[/bold]",
             "<|im_end|>", "</think>", "\x00\x1b[31m", "\ud800", "a\udfffb", "\u202e", "a" * 300, "é" * 50, "{", "\r\n",
             "%s%n", "1. 1. 1. 1.", "题目", "\ufffd", "null", "NaN", "12"]
JSON_POOL = [*EVIL_NUMBERS, *ODD_TEXTS, [], {}, [1, "a"], {"a": math.nan}, {"content": None}, [[[]]],
             {"message": "x"}, {"text": 3}, [None], {"": {}}, -0.0, 4.5, {"content": [{"text": None}]}]
GOOD_NUMBERS = [0, 1, 2, 3, 5, 7, 12, 16, 48, 64, 100, 2.5, 3.75, 0.5, 17.25, 120.0, 2.3333333333333335]
NUMBERS = GOOD_NUMBERS * 3 + EVIL_NUMBERS
FINISH_REASONS = ["stop"] * 6 + ["length"] * 2 + [None, "", "tool_calls", ["stop"], 1, {"a": "stop"}]

odd_text = st.one_of(st.sampled_from(ODD_TEXTS), st.text(st.characters(exclude_categories=()), max_size=8))
json_values = st.one_of(
    st.sampled_from(JSON_POOL),
    st.recursive(st.one_of(st.sampled_from(JSON_POOL), st.floats(), st.integers(), odd_text),
                 lambda inner: st.one_of(st.lists(inner, max_size=3),
                                         st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                 max_leaves=4),
)
numberish = st.sampled_from(NUMBERS)


def odds(draw, n: int) -> bool:
    """True ``n`` times out of ``n + 1`` (one draw)."""
    return draw(st.integers(0, n)) > 0


@st.composite
def spec_object(draw, kind: str):
    """A dialect's spec object: its own key names, values mostly numbers (some absurd, some lists)."""
    if not odds(draw, 6):
        return draw(json_values)
    keys = draw(st.lists(st.sampled_from(SPEC_KEYS[kind]), min_size=1, max_size=4, unique=True))
    return {key: draw(numberish) if odds(draw, 5) else draw(st.lists(numberish, max_size=4)) for key in keys}


@st.composite
def extras(draw) -> dict:
    """0-2 of the extra objects servers attach (each dialect's, plus junk under telling names)."""
    out = {}
    for name in draw(st.lists(st.sampled_from(EXTRA_NAMES), max_size=2, unique=True)):
        if name in ("ddtree", "ddtree_stats", "timings"):
            out[name] = draw(spec_object(name))
        elif name == "meta_info":
            out[name] = draw(spec_object("spec_tokens_details"))
        elif name == "metrics":
            stats = draw(spec_object("speculative_decoding"))
            out[name] = {"speculative_decoding": stats} if odds(draw, 4) else None  # vLLM sends null when off
        elif name == "sglext":
            out[name] = {"spec_tokens_details": draw(spec_object("spec_tokens_details"))}
        else:
            out[name] = draw(json_values)
    return out


EXTRA_NAMES = ["ddtree", "ddtree_stats", "metrics", "sglext", "timings", "meta_info", "logprobs", "error", "notes"]


@st.composite
def content(draw):
    if odds(draw, 4):
        return draw(odd_text)
    if odds(draw, 1):
        return [draw(st.sampled_from([{"type": "text", "text": t} for t in ODD_TEXTS] + JSON_POOL))
                for _ in range(draw(st.integers(0, 3)))]
    return draw(json_values)


@st.composite
def message(draw):
    if not odds(draw, 8):
        return draw(json_values)
    out = {"content": draw(content())}
    if not odds(draw, 2):
        out[draw(st.sampled_from(["reasoning_content", "reasoning", "role"]))] = draw(odd_text)
    return out


@st.composite
def logprobs(draw):
    if not odds(draw, 1):
        return draw(json_values)
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        if not odds(draw, 5):
            entries.append(draw(json_values))
            continue
        top = [{"token": draw(odd_text), "logprob": draw(numberish)} for _ in range(draw(st.integers(0, 2)))]
        entries.append({"token": draw(odd_text), "logprob": draw(numberish),
                        "top_logprobs": top if odds(draw, 5) else draw(json_values)})
    return {"content": entries if odds(draw, 6) else draw(json_values)}


@st.composite
def choice(draw, key: str):
    if not odds(draw, 10):
        return draw(json_values)
    out = {key: draw(message()), "finish_reason": draw(st.sampled_from(FINISH_REASONS))}
    for name in draw(st.lists(st.sampled_from(["logprobs", "index", "timings", "sglext"]), max_size=2, unique=True)):
        out[name] = draw(logprobs()) if name == "logprobs" else draw(spec_object("timings")) if name == "timings" \
            else draw(numberish) if name == "index" else draw(json_values)
    return out


@st.composite
def completion(draw, key: str = "message"):
    """A chat completion (key "message") or a stream chunk (key "delta")."""
    body = draw(extras())
    for name in draw(st.lists(st.sampled_from(["id", "object", "model", "usage"]), max_size=3, unique=True)):
        if name == "usage":
            body[name] = {"prompt_tokens": draw(numberish), "completion_tokens": draw(numberish)} \
                if odds(draw, 5) else draw(json_values)
        else:
            body[name] = draw(odd_text)
    if odds(draw, 20):
        body["choices"] = [draw(choice(key)) for _ in range(1 + (not odds(draw, 6)))]
    elif odds(draw, 1):
        body["choices"] = draw(json_values)
    return body


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


BREAKS = ["truncate", "invalid_utf8", "nest", "nest_deep", "bigint", "garbage", "empty", "not_object",
          "surrogate_bytes"]


@st.composite
def mangled(draw, value) -> bytes:
    """The JSON text of ``value``: intact four times in five, else broken the way servers break it."""
    data = _dumps(value)
    how = draw(st.sampled_from(["intact"] * 4 * len(BREAKS) + BREAKS))
    if how == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "invalid_utf8":
        at = draw(st.integers(0, len(data)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xe9", b"\xed\xa0\x80", b"\xf8\x88\x80"]))
        return data[:at] + bad + data[at:]
    if how == "nest":
        depth = draw(st.sampled_from([65, 200, 990]))
        return b'{"choices": ' + b"[" * depth + b"]" * depth + b"}"
    if how == "nest_deep":
        return b"[" * 100_000 + b"]" * 100_000
    if how == "bigint":
        return b'{"usage": {"completion_tokens": 1' + b"0" * 5000 + b'}, "choices": [{"message": {"content": "x"}}]}'
    if how == "garbage":
        return draw(st.binary(max_size=40))
    if how == "empty":
        return b""
    if how == "not_object":
        return _dumps(draw(json_values))
    if how == "surrogate_bytes":  # CESU-8 style surrogates: not UTF-8
        return data.replace(b"o", b"\xed\xb0\x80", 1)
    return data


@st.composite
def plain_reply(draw) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) for a non-streamed request."""
    status = draw(st.sampled_from([200] * 60 + [201, 204, 301, 302, 307, 400, 401, 403, 404, 429, 500, 503]))
    types = ["application/json"] * 4 + ["application/json; charset=utf-8", "text/html", "text/plain", ""]
    headers = {"content-type": draw(st.sampled_from(types))}
    if 300 <= status < 400 and draw(st.booleans()):
        headers["location"] = draw(st.sampled_from(["http://other:1/v1", "/relative", "\u00e9\u00e9"]))
    return status, headers, draw(mangled(draw(completion("message"))))


@st.composite
def sse_event(draw) -> bytes:
    kind = draw(st.sampled_from(["chunk"] * 12 + ["comment", "raw", "error", "empty", "multiline", "odd"]))
    if kind == "chunk":
        return b"data: " + draw(mangled(draw(completion("delta")))).replace(b"\n", b" ").replace(b"\r", b" ") + b"\n\n"
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "raw":
        return b"data: " + draw(st.binary(max_size=30)).replace(b"\n", b"").replace(b"\r", b"") + b"\n\n"
    if kind == "error":
        return b"event: error\ndata: " + _dumps(draw(json_values)) + b"\n\n"
    if kind == "empty":
        return b"\n\n"
    if kind == "multiline":
        return b'data: {"choices": [{"delta":\ndata: {"content": "x"}}]}\n\n'
    return draw(st.sampled_from([b"data:\r\n\r\n", b"id: 1\nretry: x\n\n", b"data: {\r\r", b"event:\n\n"]))


@st.composite
def stream_reply(draw) -> tuple[int, dict[str, str], list[bytes]]:
    """(status, headers, body chunks) for a streamed request, cut into arbitrary pieces."""
    status = draw(st.sampled_from([200] * 40 + [301, 401, 500]))
    content_type = draw(st.sampled_from(["text/event-stream"] * 8 + ["text/event-stream; charset=utf-8",
                                                                    "application/json", "text/html", ""]))
    if content_type.startswith("text/event-stream"):
        events = [draw(sse_event()) for _ in range(draw(st.integers(1, 8)))]
        endings = [b"data: [DONE]\n\n"] * 4 + [b"", b"data: [DONE]", b"data: [DONE]\n\ndata: x\n\n"]
        ending = draw(st.sampled_from(endings))
        data = b"".join(events) + ending
    else:
        data = draw(mangled(draw(completion("message"))))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces, last = [], 0
    for cut in [*cuts, len(data)]:
        pieces.append(data[last:cut])
        last = cut
    return status, {"content-type": content_type}, [p for p in pieces if p]


OWNERS = ["vllm", "sglang", "llamacpp", "ddtree", "ddtree-mlx", "x", "", None, 3, ["vllm"]]


@st.composite
def models_reply(draw) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of /v1/models: mostly a list of models with odd ids and owners."""
    status = draw(st.sampled_from([200] * 12 + [301, 401, 404, 500]))
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        if odds(draw, 5):
            model_id = draw(st.sampled_from(["m", "Qwen/Qwen3-8B"])) if odds(draw, 2) else draw(json_values)
            entries.append({"id": model_id, "owned_by": draw(st.sampled_from(OWNERS))})
        else:
            entries.append(draw(json_values))
    body = {"object": "list", "data": entries if odds(draw, 6) else draw(json_values)} if odds(draw, 6) \
        else draw(json_values)
    return status, {"content-type": "application/json"}, draw(mangled(body))


COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos"]
GOOD_VALUES = ["0", "1", "3.5", "17", "1200", "4e3"]
EVIL_VALUES = ["NaN", "+Inf", "-Inf", "-4", "1e400", "1e300", "9007199254740993", "abc", "", "0x10", "1_000"]


@st.composite
def metrics_pages(draw) -> tuple[tuple, tuple]:
    """Two scrapes of a Prometheus page, before and after a request: mostly vLLM's spec counters
    (one series per engine) that grew, sometimes NaN, infinite, negative, huge, shrinking,
    mislabelled or another exporter's names; sometimes the page itself is broken."""
    prefix = draw(st.sampled_from(["vllm:"] * 6 + ["llamacpp:", "ddtree_", "x_"]))
    dirty = not odds(draw, 2)  # a third of the pairs carry bad values or labels; the rest are clean
    good_labels = ['{engine="0"}', '{engine="1"}', '{position="2"}', ""]
    bad_labels = ['{position="abc"}', '{position=""}', '{a="\\"}', "{", '{position="99999999999999999999"}']
    before, after = [], []
    for _ in range(draw(st.integers(0, 8))):
        name = prefix + draw(st.sampled_from(COUNTERS)) + draw(st.sampled_from(["_total"] * 6 + ["", "_created"]))
        labels = draw(st.sampled_from(good_labels * 3 + bad_labels if dirty else good_labels))
        first = draw(st.sampled_from(GOOD_VALUES * 3 + EVIL_VALUES if dirty else GOOD_VALUES))
        growth = ["+0", "+1", "+3", "+12", "+40"]
        grown = draw(st.sampled_from(growth * 3 + [*EVIL_VALUES, "-1"] if dirty else growth))
        second = grown if not grown.startswith(("+", "-1")) else _add(first, grown)
        if not odds(draw, 3):
            comment = f"# TYPE {name.removesuffix('_total')} {draw(st.sampled_from(['counter', 'gauge', 'x']))}"
            before.append(comment)
            after.append(comment)
        before.append(f"{name}{labels} {first}")
        after.append(f"{name}{labels} {second}")
    return _page(draw, before), _page(draw, after)


def _add(value: str, delta: str) -> str:
    try:
        return repr(float(value) + float(delta))
    except ValueError:
        return value


def _page(draw, lines: list[str]) -> tuple[int, dict[str, str], bytes]:
    status = draw(st.sampled_from([200] * 20 + [404, 500]))
    data = ("\n".join(lines) + draw(st.sampled_from(["\n", "", "\n# EOF\n"]))).encode()
    if not odds(draw, 20):
        data += b"\xff\xfe"
    return status, {"content-type": "text/plain; version=0.0.4"}, data


@st.composite
def metrics_page(draw) -> tuple[int, dict[str, str], bytes]:
    """One scrape (see ``metrics_pages``)."""
    return draw(metrics_pages())[draw(st.integers(0, 1))]
