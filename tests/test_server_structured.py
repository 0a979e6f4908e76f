"""Structured output, tool calls, reasoning separation and /tokenize on the reference server.

The parsers (``ddtree_diag.server.parsing``) are tested in-process, at every chunk boundary. The
server runs once for the module as a real subprocess on the tiny random Qwen3 target + draft
(tests/support/engine_fixtures.py): its words are gibberish, but under a grammar they are valid
JSON all the same, which is what these tests check.
"""

from __future__ import annotations

import json
import math

import pytest

from ddtree_diag.server.parsing import (
    AnswerParser,
    ForcedToolCall,
    ReasoningSplitter,
    TaggedToolCalls,
    assemble,
)


def split_whole(text: str, prefilled: bool = True) -> tuple[str, str]:
    splitter = ReasoningSplitter(prefilled)
    first, last = splitter.feed(text), splitter.finish()
    return first[0] + last[0], first[1] + last[1]


def split_pieces(pieces: list[str], prefilled: bool = True) -> tuple[str, str]:
    splitter = ReasoningSplitter(prefilled)
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


SPLITS = [
    ("<think>\nplan it\n</think>\n\nThe answer.", ("\nplan it\n", "The answer.")),
    ("plan it</think>The answer.", ("plan it", "The answer.")),  # the template opened <think>
    ("<think>no end tag", ("no end tag", "")),  # cut by max_tokens: all reasoning, as vLLM's Qwen3 parser
    ("no tags at all", ("no tags at all", "")),
    ("</think>\n\n\nonly content\n", ("", "only content\n")),
    ("a</think>b</think>c", ("a", "b</think>c")),  # split at the first end tag only
    ("<think>", ("", "")),
    ("<thinking>is not the tag</think>x", ("<thinking>is not the tag", "x")),
    ("x < y <think> inside</think>\n", ("x < y <think> inside", "")),
]


@pytest.mark.parametrize("text, expected", SPLITS)
def test_reasoning_splitter_whole_text(text, expected):
    assert split_whole(text) == expected


@pytest.mark.parametrize("text, expected", SPLITS)
def test_reasoning_splitter_any_chunking_gives_the_same_split(text, expected):
    assert split_pieces(list(text)) == expected  # one character at a time: every tag cut everywhere
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split_pieces([text[:i], text[i:j], text[j:]]) == expected, (i, j)


# The template did not open the think block (Qwen3's, one that ignores thinking): only a text
# that opens one itself has reasoning; anything else is the answer, tags and all.
OWN_SPLITS = [
    ("<think>\nplan it\n</think>\n\nThe answer.", ("\nplan it\n", "The answer.")),
    ("  <think>plan</think>A.", ("plan", "A.")),
    ("<think>no end tag", ("no end tag", "")),
    ("no tags at all", ("", "no tags at all")),
    ("plan it</think>The answer.", ("", "plan it</think>The answer.")),
    ("<thin", ("", "<thin")),
    ("<thinking>x", ("", "<thinking>x")),
    ("", ("", "")),
]


@pytest.mark.parametrize("text, expected", OWN_SPLITS)
def test_reasoning_splitter_without_a_prefilled_block(text, expected):
    assert split_whole(text, prefilled=False) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split_pieces([text[:i], text[i:j], text[j:]], prefilled=False) == expected, (i, j)


def test_reasoning_splitter_holds_back_a_partial_end_tag():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")  # could be the leading <think>
    assert splitter.feed("nk>step one</th") == ("step one", "")  # "</th" held back
    assert splitter.feed("ink>\n") == ("", "")  # the newline after the tag is dropped
    assert splitter.feed("\nDone") == ("", "Done")
    assert splitter.finish() == ("", "")


def test_reasoning_splitter_releases_a_held_back_non_tag():
    splitter = ReasoningSplitter()
    assert splitter.feed("a </t") == ("a ", "")
    assert splitter.feed("able>") == ("</table>", "")
    assert splitter.finish() == ("", "")
    splitter = ReasoningSplitter()
    assert splitter.feed("ends in </thin") == ("ends in ", "")
    assert splitter.finish() == ("</thin", "")


def ids():
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def run_parser(parser, pieces):
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


FORCED = '{"name": "get_weather", "arguments": {"city": "Paris \\"}{\\" ", "days": [1, {"x": 2}]}}'


def test_forced_call_streams_its_header_then_the_arguments_as_written():
    parser = ForcedToolCall(["get_weather", "other"], make_id=ids())
    deltas = run_parser(parser, list(FORCED))
    first = deltas[0]["tool_calls"][0]
    assert first == {"index": 0, "id": "call_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert arguments == '{"city": "Paris \\"}{\\" ", "days": [1, {"x": 2}]}'
    assert parser.complete
    whole = ForcedToolCall(["get_weather"], make_id=ids())
    assert assemble(run_parser(whole, [FORCED])) == assemble(deltas)


@pytest.mark.parametrize("text, named, expected", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ('{"arguments": {"a": 1}, "name": "f"}', None, [("f", '{"a": 1}')]),  # read whole at the end
    ('[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"b": 2}}]', None,
     [("f", "{}"), ("g", '{"b": 2}')]),
    ('{"a": 1}', "f", [("f", '{"a": 1}')]),  # a named function's bare arguments
])
def test_forced_call_shapes(text, named, expected):
    for pieces in ([text], list(text)):
        message = assemble(run_parser(ForcedToolCall(["f", "g"], named, make_id=ids()), pieces))
        assert message["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == expected


def test_forced_call_cut_short_is_incomplete():
    parser = ForcedToolCall(["get_weather"], make_id=ids())
    run_parser(parser, [FORCED[:40]])
    assert not parser.complete
    assert AnswerParser(tool_mode="forced", tool_names=["get_weather"]).finish_reason("length") == "length"


TAGGED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "nope", "arguments": {}}</tool_call> tail <tool')


def test_tagged_calls_become_tool_calls_and_the_rest_stays_content():
    expected_content = ('Let me check.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call> tail <tool')
    whole = assemble(run_parser(TaggedToolCalls(["get_weather"], make_id=ids()), [TAGGED]))
    assert whole["content"] == expected_content  # an unknown function's block stays text
    assert whole["tool_calls"] == [{"id": "call_0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    for cut in range(len(TAGGED) + 1):
        pieces = [TAGGED[:cut], TAGGED[cut:]]
        assert assemble(run_parser(TaggedToolCalls(["get_weather"], make_id=ids()), pieces)) == whole, cut


def test_tagged_block_that_does_not_parse_stays_content():
    text = "<tool_call>{not json}</tool_call>"
    message = assemble(run_parser(TaggedToolCalls(["f"]), [text]))
    assert message == {"content": text}


def test_answer_parser_splits_reasoning_before_reading_calls():
    parser = AnswerParser(thinking=True, tool_mode="auto", tool_names=["f"], make_id=ids())
    text = '<think>\nuse f</think>\n\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    message = parser.message(text)
    assert message["reasoning_content"] == "\nuse f"
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert parser.finish_reason("stop") == "tool_calls"
    plain = AnswerParser()
    assert plain.message("<think>x</think>y") == {"content": "<think>x</think>y"}  # thinking off: untouched
    assert plain.finish_reason("stop") == "stop"


# ---------------------------------------------------------------------------------------------
# Over the wire: `ddtree-diag serve` on the tiny random model

API_KEY = "structured-key"
CONTEXT = 2048
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                    "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from tests.support.engine_fixtures import edit_json, serving, tiny_models

    target, draft = tiny_models(tmp_path_factory.mktemp("tiny"))
    # one token per byte: the tools note alone is ~500 tokens, past the fixture's 512 positions
    edit_json(target / "config.json", max_position_embeddings=CONTEXT)
    with serving(target, draft, "--api-key", API_KEY) as url:
        yield url


def post(url: str, body: dict, path: str = "/v1/chat/completions", headers: dict | None = AUTH):
    import httpx

    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def chat(content: str = "Weather in Paris?", **fields) -> dict:
    # a call's own text ({"name": "get_weather", "arguments": ) is 36 tokens of one byte each
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 128, "temperature": 0, **fields}


def answer(url: str, body: dict) -> dict:
    reply = post(url, body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed(url: str, body: dict) -> tuple[list[dict], str]:
    """(the choices' deltas, the finish reason) of a streamed request."""
    import httpx

    deltas, finish = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    return deltas, finish


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def calls_of(message: dict) -> list[tuple[str, dict]]:
    """(name, parsed arguments) of each call, each validated against its tool's parameters."""
    import jsonschema

    calls = []
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, PARAMETERS[name])
        calls.append((name, arguments))
    return calls



@pytest.mark.engine
def test_json_schema_answer_validates(server):
    import jsonschema

    choice = answer(server, chat(response_format=response_format(SCHEMA)))
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"


@pytest.mark.engine
def test_json_object_answer_is_an_object(server):
    # Any object: the random model may write a key for hundreds of tokens before it closes one; for
    # this prompt it closes after 19 (one byte per token).
    choice = answer(server, chat("What time is it?", response_format={"type": "json_object"}))
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict), choice


@pytest.mark.engine
@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "clock"}),
    ({"type": "function", "function": {"name": "clock"}}, {"clock"}),
])
def test_forced_tool_calls_come_back_as_tool_calls(server, tool_choice, names):
    choice = answer(server, chat(tools=TOOLS, tool_choice=tool_choice))
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    [(name, _)] = calls_of(message)
    assert name in names


@pytest.mark.engine
def test_streamed_tool_call_reassembles_to_the_whole_answer(server):
    body = chat(tools=TOOLS, tool_choice="required")
    whole = answer(server, body)["message"]
    deltas, finish = streamed(server, body)
    pieces = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"]
    assert len(pieces) > 1  # the arguments arrive in pieces after the header
    assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    expected = whole["tool_calls"][0]["function"]
    assert (pieces[0]["function"]["name"], arguments) == (expected["name"], expected["arguments"])
    assert finish == "tool_calls" and not "".join(d.get("content") or "" for d in deltas)


@pytest.mark.engine
@pytest.mark.parametrize("fields", [
    {"response_format": response_format(SCHEMA)},
    {"tools": TOOLS, "tool_choice": "required"},
])
def test_tree_and_ar_give_the_same_constrained_answer(server, fields):
    ar = answer(server, chat(tree_budget=0, **fields))["message"]
    tree = answer(server, chat(tree_budget=16, **fields))["message"]
    if "tool_calls" in ar:
        ar, tree = calls_of(ar), calls_of(tree)
    assert ar == tree


@pytest.mark.engine
@pytest.mark.parametrize("budget", [0, 16])
def test_constrained_answer_with_logprobs_carries_finite_ones(server, budget):
    # The lossless baseline asks for logprobs; under a grammar the masked tokens are -inf, which
    # JSON cannot carry (it was a 500). They are no candidates: left out of top_logprobs.
    choice = answer(server, chat(response_format=response_format(SCHEMA), tree_budget=budget, logprobs=True,
                                 top_logprobs=5))
    entries = choice["logprobs"]["content"]
    assert entries
    values = [e["logprob"] for e in entries] + [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert all(math.isfinite(v) and v <= 0 for v in values), values
    assert any(len(e["top_logprobs"]) < 5 for e in entries)  # the grammar left fewer than 5 candidates


@pytest.mark.engine
@pytest.mark.parametrize("fields, param, needle", [
    ({"response_format": response_format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
    ({"response_format": response_format({"type": "nonsense"})}, "response_format.json_schema.schema", "nonsense"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools",
     "has space"),
])
def test_what_cannot_be_constrained_is_a_400_naming_it(server, fields, param, needle):
    reply = post(server, chat(**fields))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and needle in error["message"], error


@pytest.mark.engine
def test_streamed_reasoning_matches_the_whole_answer(server):
    body = chat("Think first.", max_tokens=12, enable_thinking=True)
    whole = answer(server, body)["message"]
    # the tiny template does not open a think block and the text does not open one: all content
    assert whole["content"] and whole["reasoning_content"] is None
    deltas, _ = streamed(server, body)
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    assert not "".join(d.get("reasoning_content") or "" for d in deltas)
    off = answer(server, chat("Think first.", max_tokens=4, enable_thinking=False))["message"]
    assert "reasoning_content" not in off  # thinking off: no reasoning parser runs


@pytest.mark.engine
@pytest.mark.parametrize("fields", [{}, {"chat_template_kwargs": {"enable_thinking": False}},
                                    {"enable_thinking": True}])
def test_tokenize_counts_what_a_chat_request_sends(server, fields):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tokens = post(server, {"messages": messages, **fields}, "/tokenize").json()
    usage = post(server, {"messages": messages, "max_tokens": 1, **fields}).json()["usage"]
    assert tokens["count"] == len(tokens["tokens"]) == usage["prompt_tokens"]
    with_tools = post(server, {"messages": messages, "tools": TOOLS, **fields}, "/tokenize").json()
    usage = post(server, {"messages": messages, "max_tokens": 1, "tools": TOOLS, **fields}).json()["usage"]
    assert with_tools["count"] == usage["prompt_tokens"] > tokens["count"]  # the tools note is in the prompt


@pytest.mark.engine
def test_tokenize_shape_auth_and_models_max_len(server):
    import httpx

    models = httpx.get(f"{server}/v1/models", headers=AUTH).json()["data"][0]
    text = post(server, {"prompt": "hello", "return_token_strs": True}, "/tokenize").json()
    assert text["count"] == 5 and text["max_model_len"] == models["max_model_len"] == CONTEXT
    assert "".join(text["token_strs"]) == "hello"
    messages = [{"role": "user", "content": "hi"}]
    bare = post(server, {"messages": messages, "add_generation_prompt": False}, "/tokenize").json()
    assert bare["count"] < post(server, {"messages": messages}, "/tokenize").json()["count"]
    assert post(server, {"prompt": "x"}, "/tokenize", headers=None).status_code == 401
    refused = post(server, {"prompt": "x", "messages": messages}, "/tokenize")
    assert refused.status_code == 400 and "prompt" in refused.json()["error"]["message"]
    health = httpx.get(f"{server}/health").json()
    assert health["capabilities"]["structured_output"] == "llguidance"
