"""gpt-oss's harmony format: an answer's analysis message is its reasoning, its final message the
content, a commentary message to a function a tool call, whatever the thinking setting; the engine
decodes it that way, streamed or whole, and the detector catches the format leaking as text."""

from __future__ import annotations

import pytest

from ddtree_diag.server.parsing import AnswerParser, harmony_as_think

ANSWER = ("<|channel|>analysis<|message|>The user wants a greeting.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there!")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
# the recipient in the role's header, as gpt-oss's template writes past calls
ROLE_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
             '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')
TWO_THOUGHTS = ("<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis"
                "<|message|>Second thought.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 4.")
PREAMBLE = ("<|channel|>commentary<|message|>Let me check.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>It is sunny.")
FIRST_IS_A_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'


def _pieces(text: str) -> list[str]:
    """``text`` cut as a tokenizer would: each special token whole, words apart."""
    import re

    return [p for p in re.split(r"(<\|[a-z]+\|>|\s+)", text) if p]


def test_an_answer_becomes_a_think_block_then_its_final_text():
    assert harmony_as_think(ANSWER) == "<think>The user wants a greeting.</think>Hello there!"
    assert harmony_as_think("<|channel|>final<|message|>Just this.") == "Just this."
    assert harmony_as_think("plain text, no harmony") == "plain text, no harmony"


@pytest.mark.parametrize("text", [CALL, ROLE_CALL, CALL.removesuffix("<|call|>")])  # the last: its stop token cut
def test_a_message_to_a_function_is_a_tool_call(text):
    assert harmony_as_think(text) == (
        '<think>Need the weather.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    parser = AnswerParser(thinking=True, prefilled=False, tool_mode="auto", tool_names=["get_weather"])
    message = parser.message(harmony_as_think(text))
    assert message["reasoning_content"] == "Need the weather."
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and call["arguments"].replace(" ", "") == '{"city":"Paris"}'


def test_messages_around_the_answer():
    assert harmony_as_think(TWO_THOUGHTS) == "<think>First thought.\nSecond thought.</think>The answer is 4."
    assert harmony_as_think(PREAMBLE) == "Let me check.\n\nIt is sunny."
    assert harmony_as_think("<|channel|>commentary to=functions.now <|constrain|>json<|message|><|call|>") == (
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    # analysis after the answer began is left out (a stream already sent the closed think block)
    assert harmony_as_think("<|channel|>final<|message|>Done.<|end|><|start|>assistant<|channel|>analysis"
                            "<|message|>late") == "Done."


@pytest.mark.parametrize("text", [ANSWER, CALL, ROLE_CALL, TWO_THOUGHTS, PREAMBLE, FIRST_IS_A_CALL])
def test_a_growing_answer_only_grows(text):
    pieces, shown = _pieces(text), ""
    for end in range(1, len(pieces) + 1):
        now = harmony_as_think("".join(pieces[:end]))
        assert now.startswith(shown), (shown, now)
        shown = now
    assert shown == harmony_as_think(text)


def test_the_engine_decodes_a_harmony_answer_and_always_splits_its_reasoning(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ddtree_diag.backends.engine import split_reasoning
    from ddtree_diag.engine import load_engine
    from ddtree_diag.server.prompting import speaks_harmony, think_prefilled
    from tests.support import engine_fixtures as fx

    target = fx.make_target(tmp_path / "t", model_type="gpt_oss")
    tokenizer = fx.make_tokenizer(tmp_path / "t", harmony=True)
    engine = load_engine(target, device="cpu")
    assert engine.harmony and speaks_harmony(tokenizer)
    assert not speaks_harmony(fx.make_tokenizer(tmp_path / "plain"))
    # <|return|> ends the turn, <|end|> (the analysis message's) does not
    assert tokenizer.convert_tokens_to_ids("<|return|>") in engine.stop_token_ids
    assert tokenizer.convert_tokens_to_ids("<|end|>") not in engine.stop_token_ids
    ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    text = engine.decode_text(ids)
    assert text == "<think>The user wants a greeting.</think>Hello there!"
    for thinking in (None, False, True):  # the template opens no think block: harmony_as_think does
        assert not think_prefilled(tokenizer, thinking)
    assert split_reasoning(text) == ("Hello there!", "The user wants a greeting.")
    # streamed token by token, the text sent equals the final text
    from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

    for answer in (ANSWER, TWO_THOUGHTS, CALL):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        sent: list[str] = []
        request = DecodeRequest(
            prompt_ids=[1], mode="ar", tree_budget=0, max_tokens=len(ids) + 1, stop_ids=set(engine.stop_token_ids),
            on_token=lambda _ids, delta, out=sent: out.append(delta),
        )
        recorder = GenerationRecorder(request, engine.decode_text)
        for token in ids:
            recorder.round([token], tree_size=1)
        # a call's <|call|> stops it and is cut from the text: the call still closes
        assert "".join(sent) == recorder.text() == harmony_as_think(answer)


def test_stripped_harmony_in_a_served_answer_is_garbage():
    from ddtree_diag.checks.quality import assess

    stripped = "analysisThe user wants a greeting.assistantfinalHello there!"
    verdict = assess(stripped, prompt="Say hello.", finish_reason="stop")
    assert verdict.garbage and "template_leak" in verdict.codes
    assert not assess("Hello there!", prompt="Say hello.", finish_reason="stop").garbage


def test_a_freed_tokenizers_answer_is_not_given_to_the_next_one_at_its_address(tmp_path):
    """Answers are kept per tokenizer object by its id, which Python reuses once an object is
    freed: a gpt-oss tokenizer allocated where a plain one lived must still be found harmony."""
    pytest.importorskip("transformers")
    import gc
    import weakref

    from ddtree_diag.server import prompting
    from tests.support import engine_fixtures as fx

    harmony = fx.make_tokenizer(tmp_path / "harmony", harmony=True)
    gone = fx.make_tokenizer(tmp_path / "plain")
    assert not prompting.speaks_harmony(gone)
    stale = weakref.ref(gone)
    del gone
    gc.collect()
    assert stale() is None
    # as if the plain tokenizer had lived at the gpt-oss one's address: its answer left behind
    for question, setting in (("harmony", None), ("prefilled", True)):
        prompting._PER_TOKENIZER[(question, id(harmony), setting)] = (stale, question == "prefilled")
    assert prompting.speaks_harmony(harmony)
    assert not prompting.think_prefilled(harmony, True)
