"""Constrained decoding (engine/grammar.py): JSON mode, JSON Schema and tool calls with llguidance.

Tiny random-weight Qwen3 target + random DFlash draft on CPU in fp32: the constrained output is
valid, and chain/tree output equals constrained AR token for token on both decoders (eager and
fast). An oracle draft that proposes the constrained answer makes whole blocks accepted, so each
node's own path mask is what decides. The last test runs the embedded SmolLM2 (real_model).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.grammar import Constraint, GrammarError, GrammarState, compile_constraint  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import PROMPTS  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

# Bounded: every field has a short finite form, so a random model completes it within MAX_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "color", "n", "tag"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
PING = {  # a "#/..." reference: resolved inside the tool's own parameters document
    "$defs": {"flag": {"type": "boolean"}},
    "type": "object",
    "properties": {"loud": {"$ref": "#/$defs/flag"}},
    "required": ["loud"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
]
MAX_TOKENS = 72
MODES = (("chain", None), ("tree", 2), ("tree", 16), ("tree", 64))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    return load_engine(fx.make_target(root / "target"), fx.make_draft(root / "draft", block_size=4),
                       device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def constraints(engine) -> dict[str, Constraint]:
    tok = engine.tokenizer
    return {
        "json_object": compile_constraint(tok, response_format={"type": "json_object"}),
        "json_schema": compile_constraint(
            tok, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
        ),
        "required": compile_constraint(tok, tools=TOOLS, tool_choice="required"),
        "named": compile_constraint(tok, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}),
    }


def generate(engine, path: str, **kwargs):
    """One generation on decode path ``path`` (the engine's own setting is restored)."""
    previous = engine.decode_path
    engine.use_path(path)
    try:
        return engine.generate_ids(**kwargs)
    finally:
        engine.use_path(previous)


def check_accounting(gen) -> None:
    assert gen.decode_rounds == len(gen.acceptance_lengths) == len(gen.tree_sizes)
    assert sum(gen.acceptance_lengths) == gen.completion_tokens - 1 == len(gen.token_ids) - 1


def parsed(engine, gen) -> object:
    """The output as JSON: it ended because the grammar was complete, with no stop token."""
    assert gen.finish_reason == "stop", gen.text
    assert gen.token_ids[-1] not in engine.stop_token_ids
    return json.loads(gen.text)


# ---- valid output ------------------------------------------------------------------------------


def test_json_object_output_is_a_json_object(engine, constraints):
    completed = 0
    for prompt in PROMPTS:
        gen = engine.generate_ids(prompt, mode="ar", max_tokens=MAX_TOKENS, constraint=constraints["json_object"])
        assert gen.text.startswith("{")  # the grammar holds from the first token
        if gen.finish_reason == "stop":  # a random model may write one long string until max_tokens
            completed += 1
            assert isinstance(parsed(engine, gen), dict)
    assert completed >= 1


@pytest.mark.parametrize("path", ["eager", "fast-nograph"])
def test_json_schema_output_validates(engine, constraints, path):
    for prompt in PROMPTS:
        gen = generate(engine, path, prompt_ids=prompt, tree_budget=16, max_tokens=MAX_TOKENS,
                       constraint=constraints["json_schema"])
        jsonschema.validate(parsed(engine, gen), SCHEMA)
        check_accounting(gen)
        assert gen.extras["grammar"] == "json_schema" and gen.extras["grammar_pruned_nodes"] > 0


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_call_output_is_a_call_of_a_tool(engine, constraints, choice):
    constraint = constraints[choice]
    assert constraint.kind == "tool_call"
    assert constraint.tool_names == (["get_weather", "ping"] if choice == "required" else ["ping"])
    schemas = {"get_weather": WEATHER, "ping": PING}
    for prompt in PROMPTS:
        call = parsed(engine, engine.generate_ids(prompt, tree_budget=16, max_tokens=MAX_TOKENS, constraint=constraint))
        assert list(call) == ["name", "arguments"] and call["name"] in constraint.tool_names
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_sampled_output_validates_and_fast_draws_as_eager(engine, constraints):
    """T>0: masked sampling gives valid output, and on CPU the fast path draws what the eager path
    draws (pruned rows are left out of both draws alike)."""
    for prompt in PROMPTS:
        runs = [
            generate(engine, path, prompt_ids=prompt, tree_budget=16, max_tokens=MAX_TOKENS, temperature=1.0,
                     seed=5, constraint=constraints["json_schema"])
            for path in ("eager", "fast-nograph")
        ]
        assert runs[0].token_ids == runs[1].token_ids
        jsonschema.validate(parsed(engine, runs[0]), SCHEMA)


# ---- lossless ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["eager", "fast-nograph"])
@pytest.mark.parametrize("kind", ["json_schema", "required"])
def test_chain_and_tree_equal_constrained_ar(engine, constraints, path, kind):
    constraint = constraints[kind]
    for prompt in PROMPTS:
        reference = engine.generate_ids(prompt, mode="ar", max_tokens=MAX_TOKENS, constraint=constraint)
        for mode, budget in MODES:
            gen = generate(engine, path, prompt_ids=prompt, mode=mode, tree_budget=budget, max_tokens=MAX_TOKENS,
                           constraint=constraint)
            assert gen.token_ids == reference.token_ids, (prompt, mode, budget)
            assert gen.finish_reason == reference.finish_reason == "stop"
            check_accounting(gen)


def oracle_draft(engine, monkeypatch, answer: list[int], demote: set[int], tempt: list[int]) -> None:
    """Both decoders' drafts replaced by one that knows ``answer`` (prompt + constrained output).
    At depths in ``demote`` the right token is ranked second, behind the target's unconstrained
    favourite (``tempt[start + d]``: mostly a token the grammar forbids there, so it is pruned)."""
    vocab = engine.target.config.vocab_size

    def logprobs(start: int, depth: int) -> torch.Tensor:
        logits = torch.zeros(depth, vocab)
        for d in range(1, depth + 1):
            right = answer[start + d] if start + d < len(answer) else 0
            logits[d - 1, right] = 20.0
            if d in demote:
                logits[d - 1, right] = 19.0
                wrong = tempt[start + d] if start + d < len(tempt) else 1
                logits[d - 1, wrong if wrong != right else (right + 1) % vocab] = 20.0
        return torch.log_softmax(logits, -1)

    monkeypatch.setattr(engine.decoder("eager"), "_draft_logprobs",
                        lambda root, start, ctx, pos, depth: logprobs(start, depth))
    fast = engine.decoder("fast-nograph")
    monkeypatch.setattr(fast, "_draft", lambda window: fast.logprobs.copy_(logprobs(int(fast.start), fast.block - 1)))


@pytest.mark.parametrize("demote", [set(), {2}], ids=["oracle", "demoted"])
def test_oracle_draft_accepts_deep_paths_under_the_grammar(engine, constraints, monkeypatch, demote):
    """Whole blocks accepted: each verified node's mask must be its own path's (a wrong mask would
    change the argmax somewhere along the accepted path); with the right token ranked second the
    tree must still find it while the grammar prunes the first."""
    constraint, prompt = constraints["json_schema"], PROMPTS[1]
    reference = engine.generate_ids(prompt, mode="ar", max_tokens=MAX_TOKENS, constraint=constraint)
    free = engine.generate_ids(prompt, mode="ar", max_tokens=MAX_TOKENS, stop_token_ids=[])
    oracle_draft(engine, monkeypatch, prompt + reference.token_ids, demote, prompt + free.token_ids)
    for path in ("eager", "fast-nograph"):
        runs = {
            (mode, budget): generate(engine, path, prompt_ids=prompt, mode=mode, tree_budget=budget,
                                     max_tokens=MAX_TOKENS, constraint=constraint)
            for mode, budget in (("tree", 64), ("tree", 8), ("chain", None))
        }
        for key, gen in runs.items():
            assert gen.token_ids == reference.token_ids, (path, key)
            check_accounting(gen)
        assert max(runs["tree", 64].acceptance_lengths) == 4  # block 4: root + 3 accepted + bonus
        assert runs["tree", 64].mean_acceptance_length > 2.5
        assert runs["tree", 64].extras["grammar_pruned_nodes"] > 0
        if not demote:
            assert runs["chain", None].mean_acceptance_length > 2.5


def test_eager_and_fast_verify_the_same_pruned_trees(engine, constraints):
    for prompt in PROMPTS:
        eager, fast = (
            generate(engine, path, prompt_ids=prompt, tree_budget=16, max_tokens=MAX_TOKENS,
                     constraint=constraints["required"])
            for path in ("eager", "fast-nograph")
        )
        assert fast.token_ids == eager.token_ids
        assert fast.tree_sizes == eager.tree_sizes and fast.acceptance_lengths == eager.acceptance_lengths
        assert fast.extras["grammar_pruned_nodes"] == eager.extras["grammar_pruned_nodes"] > 0
        assert all(size < 16 for size in eager.tree_sizes)  # pruned before verify


def test_hybrid_target_chain_and_tree_equal_constrained_ar(tmp_path):
    target = fx.make_hybrid_target(tmp_path / "hybrid", pattern="LLAL")
    draft = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device="cpu", dtype="fp32")
    constraint = compile_constraint(engine.tokenizer, tools=TOOLS, tool_choice="required")
    prompt = PROMPTS[1]
    reference = engine.generate_ids(prompt, mode="ar", max_tokens=MAX_TOKENS, constraint=constraint)
    assert json.loads(reference.text)["name"] in ("get_weather", "ping")
    for path in ("eager", "fast-nograph"):
        for mode, budget in (("chain", None), ("tree", 4), ("tree", 32)):
            gen = generate(engine, path, prompt_ids=prompt, mode=mode, tree_budget=budget, max_tokens=MAX_TOKENS,
                           constraint=constraint)
            assert gen.token_ids == reference.token_ids, (path, mode, budget)


# ---- end of generation -------------------------------------------------------------------------


def test_stop_ids_stand_for_llguidance_eos_where_the_grammar_may_end(engine):
    """A bare integer may end after any digit (accepting, not complete): there every stop id is
    allowed and the model may end with one; a digit string is not complete before that."""
    constraint = compile_constraint(
        engine.tokenizer, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}
    )
    stops = set(engine.stop_token_ids)
    state = GrammarState(constraint, stops, engine.target.config.vocab_size)
    digits = engine.tokenizer("12", add_special_tokens=False)["input_ids"]
    state.tree([0], [-1])
    assert not any(state._allows(0, t) for t in stops)  # nothing yet: cannot end
    assert state.advance(digits) == (len(digits), False)
    state.tree([0], [-1])
    assert all(state._allows(0, t) for t in stops)
    logits = torch.zeros(1, engine.target.config.vocab_size)
    state.apply(logits)
    allowed = set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())
    assert stops <= allowed and len(allowed) == len(stops) + 10  # the stop ids and the ten digits
    assert state.advance([min(stops)]) == (1, False)  # a stop token: the recorder ends the output
    # an unconstrained stop list: the engine ends on a stop token the model chose
    gen = engine.generate_ids(PROMPTS[0], mode="ar", max_tokens=MAX_TOKENS, constraint=constraint)
    assert gen.finish_reason in ("stop", "length")
    if gen.finish_reason == "stop":
        assert gen.token_ids[-1] in stops and isinstance(json.loads(gen.text), int)


def test_grammar_completed_at_max_tokens_is_a_stop(engine, constraints):
    constraint = constraints["json_schema"]
    full = engine.generate_ids(PROMPTS[0], mode="ar", max_tokens=MAX_TOKENS, constraint=constraint)
    exact = engine.generate_ids(PROMPTS[0], tree_budget=4, max_tokens=len(full.token_ids), constraint=constraint)
    assert exact.token_ids == full.token_ids and exact.finish_reason == "stop"
    short = engine.generate_ids(PROMPTS[0], tree_budget=4, max_tokens=len(full.token_ids) - 1, constraint=constraint)
    assert short.token_ids == full.token_ids[:-1] and short.finish_reason == "length"


def test_thinking_leaves_text_free_until_the_end_of_thinking(engine):
    """thinking=True: any text (JSON-looking or not) until "</think>", then the schema."""
    tok = engine.tokenizer
    constraint = compile_constraint(tok, response_format={"type": "json_object"}, thinking=True)
    end = tok.convert_tokens_to_ids("</think>")

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    matcher = constraint.matcher()
    thought = [tok.convert_tokens_to_ids("<think>"), *ids("\nnot {json} yet\n"), end, *ids("\n\n"), *ids('{"a": 1}')]
    assert matcher.try_consume_tokens(thought) == len(thought) and matcher.is_stopped()
    matcher = constraint.matcher()
    assert matcher.try_consume_tokens([*ids("x"), end, *ids("no")]) == 2  # JSON is required after it
    plain = compile_constraint(tok, response_format={"type": "json_object"})
    assert plain.matcher().try_consume_tokens(ids("x")) == 0  # without thinking: JSON from the first token


def test_thinking_end_as_plain_text(tmp_path):
    """A tokenizer where "</think>" is text, not a special token: the free text is matched lazily
    and ends at the first "</think>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|im_end|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    constraint = compile_constraint(tok, response_format={"type": "json_object"}, thinking=True)
    matcher = constraint.matcher()
    ids = tok('hmm {"x" </think>\n{"a": 1}', add_special_tokens=False)["input_ids"]
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_stopped()


# ---- what compiles and what is refused -----------------------------------------------------------


def test_no_constraint_for_text_and_auto_or_none_tool_choice(engine):
    tok = engine.tokenizer
    assert compile_constraint(tok) is None
    assert compile_constraint(tok, response_format={"type": "text"}) is None
    assert compile_constraint(tok, tools=TOOLS) is None
    assert compile_constraint(tok, tools=TOOLS, tool_choice="auto") is None
    assert compile_constraint(tok, tools=TOOLS, tool_choice="none") is None
    with_format = compile_constraint(tok, tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert with_format.kind == "json_object"
    forced = compile_constraint(tok, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert forced.kind == "tool_call"  # a forced call has no message content to format
    # a keyword llguidance lacks matters only where a call is forced (free text is parsed, not masked)
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "if": {}}}}
    assert compile_constraint(tok, tools=[*TOOLS, odd], tool_choice="auto") is None
    named = compile_constraint(tok, tools=[*TOOLS, odd], tool_choice={"type": "function", "function": {"name": "ping"}})
    assert named.tool_names == ["ping"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "if": {}}}}),
         "response_format.json_schema uses unsupported keyword 'if'"),
        (dict(response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}),
         "response_format.json_schema is not supported: regex parse error"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
         "response_format.json_schema is not a valid JSON Schema: 5 is not valid"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema must be a JSON Schema object"),
        (dict(response_format={"type": "yaml"}), "response_format.type must be"),
        (dict(tools=[TOOLS[0], {"type": "function", "function": {"parameters": {}}}], tool_choice="required"),
         "tools[1].function has no name"),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name must be"),
        (dict(tools=[TOOLS[1], TOOLS[1]]), "tools[1].function.name 'ping' is used by another tool"),
        (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
              "dependentRequired": {"a": ["b"]}}}}], tool_choice={"type": "function", "function": {"name": "f"}}),
         "tools[1].function.parameters uses unsupported keyword 'dependentRequired'"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"minimum": "x"}}}]),
         "tools[0].function.parameters is not a valid JSON Schema: 'x' is not of type 'number' (at 'minimum')"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice names unknown tool 'nope'"),
        (dict(tool_choice="required"), "tool_choice 'required' needs at least one tool"),
        (dict(tools=TOOLS, tool_choice="always"), "tool_choice must be"),
    ],
)
def test_refused_in_one_line_naming_what(engine, kwargs, message):
    with pytest.raises(GrammarError) as caught:
        compile_constraint(engine.tokenizer, **kwargs)
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text
    assert isinstance(caught.value, UsageError)


def test_llguidance_tokenizer_is_built_once_per_tokenizer(engine, monkeypatch):
    import llguidance.hf

    compile_constraint(engine.tokenizer, response_format={"type": "json_object"})
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: pytest.fail("built twice"))
    first = compile_constraint(engine.tokenizer, response_format={"type": "json_object"})
    second = compile_constraint(engine.tokenizer, tools=TOOLS, tool_choice="required")
    assert first.tokenizer is second.tokenizer


def test_no_mask_work_without_a_constraint(engine, monkeypatch):
    """Unconstrained decoding never builds a grammar state (so no mask is computed or applied)."""
    from ddtree_diag.engine import eager
    from ddtree_diag.engine.fast import decoder

    def refuse(*args, **kwargs):
        raise AssertionError("grammar work in an unconstrained generation")

    monkeypatch.setattr(eager, "GrammarState", refuse)
    monkeypatch.setattr(decoder, "GrammarState", refuse)
    for path in ("eager", "fast-nograph"):
        for mode, budget in (("ar", None), ("chain", None), ("tree", 16)):
            gen = generate(engine, path, prompt_ids=PROMPTS[0], mode=mode, tree_budget=budget, max_tokens=12)
            assert not any(key.startswith("grammar") for key in gen.extras)


# ---- GPU and the real model ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_constrained_equal_constrained_ar(tmp_path):
    """On a GPU: the masks are applied between the captured stages (in the static logits buffer),
    and the captured accept/commit sees them: constrained fast == constrained eager AR in fp32."""
    engine = load_engine(fx.make_target(tmp_path / "target"), fx.make_draft(tmp_path / "draft", block_size=8),
                         device="cuda", dtype="fp32")
    assert engine.decode_path == "fast"
    constraint = compile_constraint(engine.tokenizer, tools=TOOLS, tool_choice="required")
    for prompt in PROMPTS:
        reference = generate(engine, "eager", prompt_ids=prompt, mode="ar", max_tokens=MAX_TOKENS,
                             constraint=constraint)
        for mode, budget in MODES:
            gen = engine.generate_ids(prompt, mode=mode, tree_budget=budget, max_tokens=MAX_TOKENS,
                                      constraint=constraint)
            assert gen.token_ids == reference.token_ids, (prompt, mode, budget)
            assert gen.extras["cuda_graphs"] and gen.extras["cuda_graph_errors"] == []
        sampled = engine.generate_ids(prompt, tree_budget=16, max_tokens=MAX_TOKENS, temperature=0.8, seed=2,
                                      constraint=constraint)
        assert json.loads(sampled.text)["name"] in constraint.tool_names


@pytest.mark.real_model
def test_real_model_json_schema_tree_equals_constrained_ar(embedded_target_dir):
    from ddtree_diag.engine import embedded

    engine = load_engine(embedded_target_dir, draft=embedded.default_draft_dir(), device="cpu", dtype="fp32")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    constraint = compile_constraint(
        engine.tokenizer, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    )
    messages = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}]
    reference = engine.generate(messages=messages, enable_thinking=False, mode="ar", max_tokens=64,
                                constraint=constraint)
    jsonschema.validate(json.loads(reference.text), schema)
    assert reference.finish_reason == "stop"
    tree = engine.generate(messages=messages, enable_thinking=False, tree_budget=32, max_tokens=64,
                           constraint=constraint)
    assert tree.mode == "tree" and tree.token_ids == reference.token_ids
    assert tree.mean_acceptance_length > 1.2  # the trained draft still gets tokens accepted under the mask


def test_a_misread_vocabulary_is_rebuilt_from_the_tokens_own_bytes(tmp_path, monkeypatch):
    """Some transformers releases convert a GGUF tokenizer without its byte-level decoder: llguidance
    then reads every "Ġ" as a literal character and its masks are for other bytes. That is caught
    and the vocabulary rebuilt from the tokens' own bytes; the constrained answer is unchanged."""
    import llguidance
    import llguidance.hf
    from llguidance._tokenizer import TokenizerWrapper

    from ddtree_diag.engine import grammar

    engine = load_engine(fx.make_target(tmp_path / "target"), fx.make_draft(tmp_path / "draft", block_size=4),
                         device="cpu", dtype="fp32")
    tok = engine.tokenizer
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    expected = engine.generate(messages=[{"role": "user", "content": "What time is it?"}], max_tokens=MAX_TOKENS,
                               mode="ar", constraint=compile_constraint(tok, response_format=fmt))
    correct = grammar._from_token_bytes(tok)
    assert grammar._misread(correct, tok) is None

    class Literal:  # the misreading: each token's piece taken as its text
        eos_token_id, bos_token_id = tok.eos_token_id, tok.bos_token_id
        special_token_ids = sorted(tok.all_special_ids)
        def __init__(self) -> None:
            self.tokens = [(p or "").encode() for p in tok.convert_ids_to_tokens(list(range(len(tok))))]

        def __call__(self, text):
            return list(tok(text, add_special_tokens=False)["input_ids"])

    misread = llguidance.LLTokenizer(TokenizerWrapper(Literal()), n_vocab=len(tok))
    _, theirs, ours = grammar._misread(misread, tok)
    assert theirs != ours  # e.g. b"\xc4\x80" ("Ā", the alphabet's stand-in) for the byte 0
    grammar._TOKENIZERS.pop(id(tok), None)
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: misread)
    rebuilt = compile_constraint(tok, response_format=fmt)
    assert rebuilt.tokenizer is not misread and grammar._misread(rebuilt.tokenizer, tok) is None
    again = engine.generate(messages=[{"role": "user", "content": "What time is it?"}], max_tokens=MAX_TOKENS,
                            mode="ar", constraint=rebuilt)
    assert again.token_ids == expected.token_ids
