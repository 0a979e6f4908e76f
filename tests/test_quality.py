"""The garbage-text detector: each signal on focused examples, quiet on hard clean text, the API."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_diag.checks.quality import (
    GARBAGE_THRESHOLD,
    REASON_CODES,
    Reason,
    Verdict,
    assess,
    assess_result,
    summarize,
)
from ddtree_diag.records import ProbeCase, ProbeResult

STORY_PROMPT = "Say hello in one short sentence."
STORY_THINKING = "Thinking to the 1. 1. 题目:\nuser:\n# user: 1.\n# 1. 1. 1. 年 1 1. 三角形\n1."
CORPUS = Path(__file__).parent / "data" / "quality"


def codes(text: str, **kwargs) -> set[str]:
    return set(assess(text, **kwargs).codes)


def flagged(text: str, code: str, **kwargs) -> bool:
    verdict = assess(text, **kwargs)
    return verdict.garbage and code in verdict.codes


# --------------------------------------------------------------------------------------------
# The story


def test_story_thinking_output_is_garbage_with_several_named_reasons():
    verdict = assess(
        STORY_THINKING,
        prompt=STORY_PROMPT,
        finish_reason="length",
        thinking=True,
        completion_tokens=48,
        max_tokens=48,
    )
    assert verdict.garbage
    assert {"degenerate_enumeration", "script_mix", "role_leak", "truncated"} <= set(verdict.codes)
    by_code = {r.code: r for r in verdict.reasons}
    assert by_code["role_leak"].evidence.startswith("user:")
    assert "题目" in by_code["script_mix"].detail
    # Evidence spans point into the text.
    for reason in verdict.reasons:
        if reason.span:
            start, end = reason.span
            assert STORY_THINKING[start:end].startswith(reason.evidence[:10])


def test_story_hello_comma_is_a_premature_stop():
    verdict = assess("Hello,", prompt=STORY_PROMPT, finish_reason="stop", completion_tokens=3, thinking=False)
    assert verdict.garbage
    assert verdict.top_reason.code == "premature_stop"
    assert verdict.top_reason.evidence == "Hello,"


# --------------------------------------------------------------------------------------------
# Each signal, garbage side


@pytest.mark.parametrize(
    ("text", "kwargs", "code"),
    [
        ("the the the the", {}, "token_loop"),
        (
            "Paris is lovely. It is a beautiful city. It is a beautiful city. It is a beautiful city. It is",
            {"finish_reason": "length"},
            "phrase_loop",
        ),
        ("I think I think I think I think I think", {"finish_reason": "length"}, "phrase_loop"),
        ("OK.\nSee you soon!\nSee you soon!\nSee you soon!\nSee you soon!", {}, "line_loop"),
        ("我的的的的的的的的的的", {"prompt": "介绍一下你自己。", "finish_reason": "length"}, "token_loop"),
        (
            "Facts:\n" + "".join(f"{i}. Water boils at one hundred degrees.\n" for i in range(1, 10)),
            {"finish_reason": "length"},
            "repeated_ngram",
        ),
    ],
)
def test_loops(text, kwargs, code):
    assert flagged(text, code, **kwargs), assess(text, **kwargs).to_dict()


@pytest.mark.parametrize("text", ["😂" * 20, "Sure!" + "\n" * 40, "ok " + "❤️" * 18])
def test_symbol_and_newline_floods_are_token_loops(text):
    assert flagged(text, "token_loop", finish_reason="length")


def test_a_passage_said_twice_in_a_row():
    passage = (
        "Speculative decoding lets a small draft model propose several tokens that the large "
        "target model verifies in a single forward pass, keeping the output unchanged. "
    )
    assert flagged("Intro. " + passage + passage + "Done.", "phrase_loop", finish_reason="stop")
    # once is fine, and so is a short sentence said twice mid-text
    assert not assess("Intro. " + passage + "Done.", finish_reason="stop").garbage
    assert not assess("Go team! Go team! We won.", finish_reason="stop").garbage


def test_a_whole_answer_said_twice_after_a_blank_line():
    answer = (
        "The sky looks blue because the air scatters sunlight, and blue light, with its shorter "
        "wavelength, is scattered far more strongly than red light."
    )
    for separator in ("\n\n", " ", "\n"):  # the second copy lacks the separator the first one ends with
        assert flagged(answer + separator + answer, "line_loop" if "\n" in separator else "phrase_loop",
                       prompt="Why is the sky blue?", finish_reason="stop"), repr(separator)
    assert not assess(answer + "\n\n" + answer, prompt="Say your answer twice.", finish_reason="stop").garbage
    # a numbered list whose lines differ only by their number is no passage said twice
    listed = "".join(f"{i}. Check the cable.\n" for i in range(1, 3))
    assert not assess(listed, prompt="Two steps, please.", finish_reason="stop").garbage


@pytest.mark.parametrize("separator", ["\n\n", " ", "\n"])
def test_a_sentence_said_three_times_without_its_last_separator_is_a_loop(separator):
    sentence = "DNS translates domain names into IP addresses so computers can find each other."
    text = separator.join([sentence] * 3)  # the last copy lacks the separator the others end with
    code = "line_loop" if "\n" in separator else "phrase_loop"
    assert flagged(text, code, prompt="Explain how DNS works.", finish_reason="stop"), repr(separator)
    assert not assess(separator.join([sentence] * 2), prompt="Explain how DNS works.", finish_reason="stop").garbage


@pytest.mark.parametrize(
    ("text", "prompt"),
    [
        ("[None, None, None, None, None, None, None, None]", "What is [None] * 8?"),
        ("The result is [True, True, True, True, True, True].", "What does [x > 0 for x in xs] give?"),
        ("It prints ['a', 'a', 'a', 'a', 'a'].", "What does list('a' * 5) print?"),
    ],
)
def test_a_literal_listing_one_word_again_is_data_not_a_loop(text, prompt):
    assert not assess(text, prompt=prompt, finish_reason="stop").garbage, assess(text, prompt=prompt).to_dict()


@pytest.mark.parametrize(
    "tail",
    ["-" * 300, "=" * 150, "*" * 200, "|---|---|\n" * 40, "| --- | --- |\n" * 30],
)
def test_markup_repeated_into_the_token_limit_is_a_loop(tail):
    text = "| a | b |\n" + tail if tail.startswith("|") else "The sky is blue because of scattering.\n" + tail
    verdict = assess(text, prompt="Why is the sky blue?", finish_reason="length")
    assert verdict.garbage and {"token_loop", "line_loop"} & set(verdict.codes), verdict.to_dict()
    # the same rule or border where the answer ended on its own is a drawing, not a loop
    assert not {"token_loop", "line_loop"} & set(codes(text, prompt="Why is the sky blue?", finish_reason="stop"))


def test_a_sentence_said_twice_where_the_reply_is_cut():
    text = "Tokyo is the capital. It is a large city with many people. It is a large city with many people."
    assert flagged(text, "phrase_loop", finish_reason="length")
    assert not assess(text, finish_reason="stop").garbage  # not at the limit: could be emphasis


def test_replacement_character_loop():
    verdict = assess("\ufffd\n" * 30, prompt=STORY_PROMPT, finish_reason="length")
    assert verdict.garbage and verdict.top_reason.code == "replacement_char"
    assert verdict.top_reason.severity == "hard"


@pytest.mark.parametrize(
    ("text", "prompt"),
    [
        (
            "The capital of France is Paris, which is known for 它的美丽的建筑和丰富的历史。",
            "What is the capital of France?",
        ),
        ("Hello! How can I помочь вам сегодня?", STORY_PROMPT),
        ("Die Hauptstadt ist Berlin, 柏林是一个城市 und sehr groß.", "Was ist die Hauptstadt Deutschlands?"),
        ("Привет! Я рад 你好 тебя видеть.", "Поздоровайся одним предложением."),
        ("Hеllo, hоw are you?", STORY_PROMPT),  # Cyrillic е and о inside Latin words
        ("Τhe sky is blυe because of scattering.", "Why is the sky blue?"),  # Greek Τ and υ
    ],
)
def test_script_switch_mid_sentence(text, prompt):
    assert flagged(text, "script_mix", prompt=prompt)


@pytest.mark.parametrize("text", ["The pressure is ρgh, and ΔH is negative.",
                                  "Torque τ = rF sinθ, with σx the stress."])
def test_greek_letters_of_maths_beside_latin_ones_are_no_homoglyphs(text):
    assert "script_mix" not in codes(text, prompt="Explain the formula.", finish_reason="stop")


def test_script_switch_without_a_prompt_uses_the_texts_own_script():
    assert flagged("The weather today is sunny and 天气很好 warm in the afternoon.", "script_mix")


@pytest.mark.parametrize(
    "text",
    [
        "Docker 是一个开源的容器平台。你可以用 Docker Compose 来管理多个 container，比如 web server 和 database。",
        "Чтобы прочитать файл в Python, используйте:\n\n```python\nwith open('data.txt', encoding='utf-8') as f:\n"
        "    for line in f:\n        print(line.strip())\n```",
        "解方程 $x^2 + 2x + 1 = 0$。因为 $x^2 + 2x + 1 = (x+1)^2$，所以 $x = -1$。\n\n"
        "$$\\frac{-b \\pm \\sqrt{b^2-4ac}}{2a} = -1$$",
        "React の useEffect フックは、コンポーネントの render 後に副作用を実行します。dependency array を渡します。",
        "Kubernetes에서 Pod는 가장 작은 배포 단위입니다. kubectl get pods 명령으로 확인할 수 있습니다.",
    ],
)
def test_without_a_prompt_an_answer_naming_code_terms_keeps_its_own_script(text):
    # code, TeX and English terms inside a Chinese / Russian / Japanese / Korean answer are no switch
    assert "script_mix" not in codes(text, finish_reason="stop")


@pytest.mark.parametrize(
    "text",
    [
        "Hello!<|im_end|>",
        "Sure.<|im_end|>\n<|im_start|>user\nmore",
        "Hi<|endoftext|>",
        "Paris.</s>",
        "Paris. [INST] and Rome? [/INST]",
        "Hi!<|eot_id|><|start_header_id|>user<|end_header_id|>",
        "Hello<end_of_turn>\n<start_of_turn>user",
        "Hi<｜end▁of▁sentence｜>",
        'Sure, let me look that up.[TOOL_CALLS][{"name": "search", "arguments": {"q": "weather"}}]',
    ],
)
def test_template_leak(text):
    assert flagged(text, "template_leak", prompt=STORY_PROMPT)


@pytest.mark.parametrize(
    "text",
    [  # gpt-oss's harmony output with its special tokens stripped (no harmony parser on the server)
        "analysisThe user wants a greeting. We should answer briefly.assistantfinalHello there! How can I help?",
        "The user asks for a capital. Paris.assistantfinalThe capital of France is Paris.",
        "analysisWe need to name the capital of France. It is Paris.",
        "Sure, calling the tool.assistantcommentary to=functions.get_weather json{\"city\": \"Paris\"}",
        "Ok.assistantfinalsure thing, here it is.",
        "analysisthe user asks for the capital. Paris.",
        "We need the weather.assistant to=functions.get_weathercommentary json{\"city\": \"Paris\"}",
        "commentary to=functions.get_weather json{\"city\": \"Paris\"}",
    ],
)
@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Give a short analysis of Paris."])
def test_stripped_harmony_channels_are_a_template_leak(text, prompt):
    assert flagged(text, "template_leak", prompt=prompt)


@pytest.mark.parametrize(
    "text",
    [
        "The analysis is final: the assistant answered, and the final analysis agrees.",
        "analysis: revenue grew 4% while costs stayed flat.",
        "Set `assistantfinal` to true in the config to skip the preamble.",
        "Our analysisThere is no such word, but analysis_final is a column name.",
        "A virtual-assistant finalizes it; see https://x.io/myassistantfinal2 and assistantcommentary_id.",
        "commentary: the data is fine.",
    ],
)
def test_words_like_the_harmony_channels_are_not_a_leak(text):
    assert "template_leak" not in assess(text, prompt="Summarise the report.", finish_reason="stop").codes


@pytest.mark.parametrize(
    "text",
    [
        "Hello!\nuser\nWhat is your name?\nassistant\nI am a bot.",
        "Hello!\n\nHuman: tell me a joke",
        "Paris.\n### Instruction:\nName the capital of Spain.\n### Response:\nMadrid",
        "Hi!\n# user: hello",
        "Sure.\nUser: and tomorrow?\nAssistant: Sunny.",
        "Hello!\nuser:",
        "assistant\n\nHello! How can I help?",
        "model\nHi there, friend!",
        "Hello! Nice to meet you.\nuser\nthanks",
    ],
)
def test_role_leak(text):
    assert flagged(text, "role_leak", prompt=STORY_PROMPT)


def test_thinking_leak_when_thinking_is_off():
    assert flagged("<think>\n\n</think>\n\nHello!", "thinking_leak", prompt=STORY_PROMPT, thinking=False)
    assert flagged("Hello!</think>", "thinking_leak", thinking=False)


def test_thinking_leak_when_reasoning_was_separated():
    assert flagged("<think>ok</think>Hello!", "thinking_leak", thinking=True, reasoning="ok")


def test_unterminated_think_block_is_garbage_on_stop_but_info_on_length():
    text = "<think>\nThe user wants a greeting. Let me think about"
    assert flagged(text, "unterminated_think", thinking=True, finish_reason="stop")
    cut = assess(text, thinking=True, finish_reason="length")
    assert not cut.garbage and cut.truncated
    assert {"unterminated_think", "truncated"} <= set(cut.codes)


def test_unterminated_think_without_finish_reason_is_soft():
    verdict = assess("<think>\nThe user wants a greeting. Let me think about", thinking=True)
    assert "unterminated_think" in verdict.codes and not verdict.garbage


def test_loops_inside_the_think_block_are_found():
    text = "<think>\n" + "wait, " * 30 + "\n</think>\n\nHello!"
    assert flagged(text, "phrase_loop", thinking=True, finish_reason="stop")


def test_loops_in_separated_reasoning_are_found_and_marked():
    verdict = assess("Hello!", thinking=True, finish_reason="stop", reasoning="Let me see. " * 20)
    assert verdict.garbage
    assert any(r.source == "reasoning" for r in verdict.reasons if r.weight > 0)


@pytest.mark.parametrize(
    "text",
    ["1. 1. 1. 1.", "Fruits:\n1.\n1.\n1.\n1.", "答案：1. 1. 1. 1. 1.", "The steps are 1. 2. 2. 2. 2."],
)
def test_degenerate_enumeration(text):
    assert flagged(text, "degenerate_enumeration", finish_reason="length")


@pytest.mark.parametrize("text", ["", "   \n ", "...", "1."])
def test_empty_output(text):
    assert flagged(text, "empty_output", prompt="List three fruits.", finish_reason="stop")


@pytest.mark.parametrize(
    "text",
    [
        "Hello,",
        "The capital of France is",
        "Here is the code:",
        "你好，",
        "Sure! The answer is the",
        "```python\ndef add(a, b):",
    ],
)
def test_premature_stop(text):
    assert flagged(text, "premature_stop", finish_reason="stop")


def test_a_long_reply_that_stops_mid_sentence_is_garbage_too():
    text = (
        "Mitochondria produce most of the cell's ATP through oxidative phosphorylation. They have their "
        "own DNA, inherited from the mother, which supports the idea that they descend from the"
    )
    assert flagged(text, "premature_stop", finish_reason="stop")
    assert not assess(text, finish_reason="length").garbage
    assert not assess("SELECT name FROM users;\nSELECT name FROM admins;", finish_reason="stop").garbage


def test_premature_stop_needs_finish_reason_stop_to_be_hard():
    unknown = assess("Hello,")
    assert "premature_stop" in unknown.codes and not unknown.garbage
    assert assess("Hello,", finish_reason="length").codes == ["truncated"]


def test_a_stop_inside_a_word_is_a_premature_stop():
    prompt = "Why is the sky blue?"
    cut = "Sunlight holds every colour. The sky is blue because of Rayleigh scatt"
    assert flagged(cut, "premature_stop", prompt=prompt, finish_reason="stop")
    assert flagged("Air molecules are small. They scatter the short wavelen", "premature_stop", prompt=prompt,
                   finish_reason="stop")
    # cut by the token limit it is only truncated; a whole last word, a name or a term is an ending
    assert not assess(cut, prompt=prompt, finish_reason="length").garbage
    # an answer that ends no sentence may end on a word the lexicon lacks ("struct"): soft, never garbage
    for text in ("The sky is blue because of Rayleigh scatt", "We store the session data with a struct",
                 "Das Design ist wirklich sehr markant"):
        verdict = assess(text, prompt=prompt, finish_reason="stop")
        assert "premature_stop" in verdict.codes and not verdict.garbage, text
    for text in ("The sky is blue because of Rayleigh scattering", "The scattering is named after Rayleigh",
                 "Install it with pip and import numpy, then call numpy"):
        assert "premature_stop" not in codes(text, prompt=prompt, finish_reason="stop"), text
    # a list item may end on a short form no list holds ("repo"): soft, never garbage alone
    listed = assess("Steps:\n- Clone the code\n- Save the file in your repo", prompt="Steps?", finish_reason="stop")
    assert not listed.garbage


@pytest.mark.parametrize(
    ("text", "finish"),
    [
        ("DNS, the Domain Name System, translates human-readable names into IP addr DNS, the Domain Name System, "
         "translates human-readable names into IP addresses so that browsers can find servers.", "stop"),
        ("The sky is blue because of Rayleigh scat\nThe sky is blue because of Rayleigh scattering, which affects "
         "shorter wavelengths more.", "stop"),
        ("Sure. The sky looks blue because sunlight is scatt The sky looks blue because sunlight is scattered by "
         "molecules in the air", "length"),
        ("Привет! Небо голубое, потому что свет рассеив Небо голубое, потому что свет рассеивается в воздухе.", "stop"),
    ],
)
def test_a_sentence_broken_off_inside_a_word_and_begun_again_is_a_restart(text, finish):
    assert flagged(text, "restart", finish_reason=finish), assess(text, finish_reason=finish).to_dict()


@pytest.mark.parametrize(
    "text",
    [
        "We will rock you\nWe will rock you\nWe will rock you, yeah.",  # a refrain ends where its copy does
        "Start spreading the news: New York, New York, it is a wonderful town.",
        "Row, row, row your boat, gently down the stream. Row, row, row your boat, gently down the stream.",
        "```\nprint('abc def ghi jk')\nprint('abc def ghi jkl')\n```",  # code
    ],
)
def test_repeats_that_end_where_their_copy_does_are_no_restart(text):
    assert "restart" not in codes(text, finish_reason="stop")


@pytest.mark.parametrize(
    ("text", "prompt"),
    [
        ("During training, documents are separated by the special token <|endoftext|>. At generation time the "
         "model stops when it produces it, token id 50256.", "How does GPT-2 know where a document ends?"),
        ("Qwen3 writes its reasoning between <think> and </think> tags before the final answer. With thinking "
         "off, the chat template inserts an empty <think></think> block.", "How do Qwen3 models show reasoning?"),
        ("ChatML wraps each turn in the <|im_start|> and <|im_end|> markers.", "How do turns work here?"),
        ("Qwen3 starts its reasoning with the <think> tag and writes its answer after the reasoning.",
         "How does Qwen3 reason?"),
    ],
)
def test_a_special_token_talked_about_in_prose_is_no_leak(text, prompt):
    verdict = assess(text, prompt=prompt, finish_reason="stop", thinking=False)
    assert not verdict.garbage, verdict.to_dict()


@pytest.mark.parametrize(
    "text",
    ["Sure, here you go.<|im_end|>\n<|im_start|>user\nThanks", "The answer is 4.<|endoftext|>The answer is",
     "<think>\nThe user wants a greeting.\n</think>\n\nHello!", "Hi there, the token<|im_end|>",
     # a token named in prose first does not excuse a leak after it
     "Documents end with the special token <|endoftext|>. Hope this helps!<|im_end|>\n<|im_start|>user\nmore"],
)
def test_an_emitted_special_token_is_still_a_leak(text):
    assert assess(text, prompt="Say hi.", finish_reason="stop", thinking=False).garbage


def test_chinese_aabb_words_are_no_stutter_but_doubled_tokens_are():
    prompt = "用中文写一句描述周末的话。"
    clean = "周末我们慢慢地走在湖边，看看风景，说说笑笑，天天都这样开开心心的，真是高高兴兴、快快乐乐的日子。"
    assert not assess(clean, prompt=prompt, finish_reason="stop").garbage
    stutter = "天天空空是是蓝蓝色色的的，因因为为光光线线散散射射。"
    assert flagged(stutter, "doubled_words", prompt=prompt, finish_reason="stop")


def test_drawings_and_morse_are_answers():
    board = "```\n   |   |   \n---+---+---\n   |   |   \n---+---+---\n   |   |   \n```"
    assert not assess(board, prompt="Draw an empty tic-tac-toe board.", finish_reason="stop").garbage
    morse = "SOS: ... --- ...\nHELLO: .... . .-.. .-.. ---"
    assert not assess(morse, prompt="Write SOS and HELLO in Morse code.", finish_reason="stop").garbage
    assert flagged("Here is the list -", "premature_stop", finish_reason="stop")  # a dash that dangles
    assert flagged("```\n.\n,\n;\n```", "empty_output", finish_reason="stop")  # marks, no drawing


def test_a_prompt_that_asks_to_sing_allows_its_refrain():
    text = ("Row, row, row your boat,\nGently down the stream.\nMerrily, merrily, merrily, merrily,\n"
            "Life is but a dream.")
    assert not assess(text, prompt="Sing Row, Row, Row Your Boat.", finish_reason="stop").garbage
    # a prompt about singing, or about someone named Carol, is no song request
    for prompt in ("Why do birds sing?", "Write a short email to Carol about the meeting."):
        assert flagged("The reason is simply because of the", "premature_stop", prompt=prompt, finish_reason="stop")


def test_lorem_ipsum_is_no_salad():
    text = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore "
            "et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut "
            "aliquip ex ea commodo consequat.")
    assert not assess(text, prompt="Give me two sentences of placeholder text.", finish_reason="stop").garbage
    assert not assess(f"<p>{text}</p>", prompt="An HTML paragraph with filler text.", finish_reason="stop").garbage


def test_stop_at_max_tokens_counts_as_truncation():
    # ddtree-mlx style servers say "stop" even when cut at max_tokens.
    verdict = assess("The capital of France is", finish_reason="stop", completion_tokens=5, max_tokens=5)
    assert verdict.truncated and not verdict.garbage


@pytest.mark.parametrize(
    "text", ["Hello\x00 world", "Result\x1b[0m is 4", "Caf\x82 au lait", "bad \ud800 surrogate"]
)
def test_control_chars(text):
    assert flagged(text, "control_chars")


@pytest.mark.parametrize(
    ("text", "finish"),
    [
        ("The answer is " + "4" * 130, "length"),  # a digit: one token to the loop search
        ("I" * 160, "length"),
        ("The answer is " + "0" * 130, "length"),  # it runs into the token limit
        ("Paris is the capital of France." + " " * 80, "length"),  # blanks up to the limit
        ("DNS maps names to addresses." + "\t" * 250 + "It also caches.", "stop"),  # a long blank run
    ],
)
def test_one_letter_digit_or_blank_flooding_is_a_token_loop(text, finish):
    assert flagged(text, "token_loop", finish_reason=finish), assess(text, finish_reason=finish).to_dict()


@pytest.mark.parametrize(
    ("text", "prompt"),
    [
        ("Zero as a 64-bit binary number: " + "0" * 64 + ".", "Write 0 as 64-bit binary."),
        ("mask = 0x" + "f" * 64 + "  # all 256 bits set", "A 256-bit all-ones mask in hex?"),
        ("Aaaaaaaaaaaaaaaaaaaah! That was a scary film.", "How was the film?"),
        ("| name | value |\n|------|-------|\n| a" + " " * 30 + "| 1 |", "A table please."),
        ("Scream: " + "A" * 80, "Write the letter A eighty times in a row."),  # asked for
        ("A googol is 1" + "0" * 100 + ", a one followed by a hundred zeros.", "What is a googol?"),
        ("The mask is 0x" + "F" * 128 + ".", "A 512-bit all-ones mask?"),
        ("The mRNA ends in a poly(A) tail: " + "A" * 80 + ".", "Show an mRNA poly(A) tail."),
        ("Step one: indent the block by" + " " * 48 + "four spaces.", "Explain indentation."),
    ],
)
def test_long_numbers_masks_and_asked_for_runs_are_no_flood(text, prompt):
    assert "token_loop" not in codes(text, prompt=prompt, finish_reason="stop")


def test_a_number_written_out_up_to_the_token_limit_is_no_flood():
    text = "Sure! A googol written out in full is:\n\n1" + "0" * 100
    assert "token_loop" not in codes(text, prompt="Write out a googol in full.", finish_reason="length")


def test_a_numbered_list_whose_item_stops_changing_is_a_loop():
    looping = "1. Make a schedule.\n" + "".join(f"{i}. Take breaks.\n" for i in range(2, 9)) + "9. Take bre"
    verdict = assess(looping, prompt="Write a list of study tips.", finish_reason="length")
    assert verdict.garbage and "line_loop" in verdict.codes, verdict.to_dict()
    assert "under 8 list numbers in a row" in next(r.detail for r in verdict.reasons if r.code == "line_loop")
    fine = "1. Make a schedule.\n2. Take breaks.\n3. Take breaks.\n4. Sleep well.\n5. Eat well."
    assert "line_loop" not in codes(fine, prompt="Write a list of study tips.", finish_reason="stop")
    # lists that repeat an item on purpose, and end
    for prompt, item, times in [("Give me a knitting pattern.", "Knit across.", 6),
                                ("Plan my lunches for a week.", "Chicken and rice", 7),
                                ("A tabata workout?", "20 s burpees, 10 s rest", 8),
                                ("Answer key for the quiz?", "Yes", 6)]:
        listed = "".join(f"{i}. {item}\n" for i in range(1, times + 1)) + "Enjoy!"
        assert not assess(listed, prompt=prompt, finish_reason="stop").garbage, (item, assess(listed).to_dict())
    # and a long stretch is a loop even where the answer ends
    stuck = "".join(f"{i}. Take a short break.\n" for i in range(1, 15)) + "Good luck!"
    assert flagged(stuck, "line_loop", prompt="Study tips?", finish_reason="stop")
    asked = "".join(f"{i}. I will not talk in class.\n" for i in range(1, 11))
    assert not assess(asked, prompt="Write 'I will not talk in class' 10 times, numbered.",
                      finish_reason="stop").garbage


@pytest.mark.parametrize("text", ["Au", "Na", "De", "CC(=O)OC1=CC=CC=C1C(=O)O", "H2O"])
def test_a_one_word_answer_or_a_formula_is_no_premature_stop(text):
    assert "premature_stop" not in codes(text, prompt="Answer in one word or formula.", finish_reason="stop")


def test_salad_after_a_prompt_of_content_words_only_is_judged_in_the_prompts_language():
    """Salad keeps few function words whole, so its own words do not tell its language, and a
    prompt like "Explain gradient descent." has no frequent word either: the one lexicon that
    holds all of the prompt's words says which language to judge the answer in."""
    prompt = "Explain gradient descent."
    salad = ("Grad ient desc ent optim isat ion meth od mov es param eters nega tive gra dient unt il "
             "lo ss stop s fall ing.")
    verdict = assess(salad, prompt=prompt, finish_reason="stop")
    assert verdict.garbage and "word_salad" in verdict.codes, verdict.to_dict()
    clean = ("Gradient descent is an optimisation method that moves the parameters along the negative "
             "of the gradient until the loss stops falling.")
    assert not assess(clean, prompt=prompt, finish_reason="stop").garbage
    # a prompt whose few words one foreign lexicon holds alone (Spanish: "paella valenciana") does
    # not make a terse English answer Spanish: English holds far more of the answer's words
    terse = ("short grain rice, chicken thighs, rabbit pieces, flat green beans, white butter beans, saffron "
             "threads, rosemary sprigs, sweet paprika, grated tomato, olive oil, salt water.")
    assert not assess(terse, prompt="Describe paella valenciana.", finish_reason="stop").garbage


def test_a_numbered_list_of_placeholders_is_no_empty_list():
    template = "".join(f"{i}. TBD\n" for i in range(1, 9))
    assert not assess(template, prompt="Make an agenda template.", finish_reason="stop").garbage
    assert flagged("Steps:\nStep 1:\nStep 2:\nStep 3:\nStep 4:\nStep 5:", "empty_list", finish_reason="stop")


def test_a_terse_list_of_jargon_after_a_short_prompt_is_no_salad():
    """A language guessed from a short prompt's lexicon ("Outline flamenco guitar.") is a guess:
    whole unknown words may be the answer's jargon, so only pieces and glued words count."""
    jargon = ("- Origins: Andalusia, Romani communities\n- Techniques: rasgueado, picado, alzapua, tremolo, golpe\n"
              "- Forms: solea, bulerias, alegrias, seguiriyas, tangos, fandangos\n- Guitars: cypress body, low action, "
              "golpeador tap plates\n- Masters: Paco de Lucia, Sabicas, Tomatito, Vicente Amigo")
    assert not assess(jargon, prompt="Outline flamenco guitar.", finish_reason="stop").garbage


def test_bare_json_is_code_not_prose():
    package = (
        '{\n  "name": "mini-api",\n  "version": "1.0.0",\n  "main": "index.js",\n  "scripts": {\n'
        '    "start": "node index.js",\n    "dev": "nodemon index.js"\n  },\n  "dependenc'
    )
    assert not assess(package, prompt="package.json for a minimal express app", finish_reason="length").garbage
    from ddtree_diag.checks.quality.context import bare_json

    assert bare_json(package) and bare_json('[{"a": 1}, {"a": 2}]')
    assert not bare_json("[1] Smith et al. (2020). A paper.\n[2] Doe (2019).\n[3] Roe.")


@pytest.mark.parametrize("text", ["L'Ã©tÃ© Ã  Paris est trÃ¨s chaud.", "Itâ€™s a nice day.", "ÐŸÑ€Ð¸Ð²ÐµÑ‚!"])
def test_mojibake(text):
    verdict = assess(text)
    assert verdict.garbage and verdict.top_reason.code == "mojibake"


@pytest.mark.parametrize("text", [
    "ĠThe Ġsky Ġlooks Ġblue Ġbecause Ġthe Ġair Ġscatters Ġsunlight.",  # byte-level BPE, spaced
    "ĠTheĠskyĠisĠblueĠbecauseĠofĠRayleighĠscattering.",  # glued
    "▁The▁sky▁looks▁blue▁because▁the▁air▁scatters▁sunlight.",  # SentencePiece
    "The sky is blue.ĊĊIt is because of scattering.ĊĊThe end.ĊThanks.",  # newline marks
    "Hello<0x0A>world<0x0A>this is a test<0xE4><0xBD><0xA0>",  # byte fallback
    "First line here.<0x0A>Second line here.",  # one byte token, glued to the words around it
    'print(<0x22>hello<0x22>)',
])
def test_undecoded_tokenizer_pieces(text):
    verdict = assess(text, prompt="Why is the sky blue?", finish_reason="stop")
    assert verdict.garbage and verdict.top_reason.code == "token_pieces", verdict.to_dict()


@pytest.mark.parametrize(("text", "prompt"), [
    # Maltese writes Ġ and Ċ as letters
    ("Ġużeppi u Ċensu marru Għawdex. Ġimgħa wara, Ġanni ġie lura mill-Ġermanja. Ċikku kien ċkejken.",
     "Ikteb paragrafu bil-Malti."),
    ("Marru (Ġużeppi), (Ċensu) u \"Ġanni\" lejn Għawdex, u [Ġorġ] ukoll.", "Min mar?"),
    ("CPU over the last hour: ▁▂▃▅▇▇▅▃▂▁▁▂▃ (peak at 12:30).", "Show CPU usage as a sparkline."),
    ("GPT-2 marks a leading space with Ġ, so \" The\" becomes ĠThe, and a newline becomes Ċ.",
     "How does BPE mark spaces?"),
    ("ĠThe ĠThe ĠThe: each piece keeps its Ġ mark.", "Show me raw GPT-2 tokenizer pieces."),
    ("Raw pieces look like `ĠThe Ġsky Ġis`, `▁The▁sky▁is` or `<0x0A><0x0A><0x0A>`: decode them first.",
     "Why does my output look odd?"),  # quoted as code
    ("In llama.cpp logs a newline shows as <0x0A> and a quote as <0x22> .", "What do odd log lines mean?"),
    # CJK prose has no spaces: a byte token named there touches its words anyway
    ("换行符在日志里显示为<0x0A>，引号显示为<0x22>。", "日志里这些奇怪的符号是什么意思？"),
    ("Examples: <0x00>, <0x0A>, and <0xFF>; the first ids are <0x00>..<0x02>.", "List a few byte tokens."),
    ("It is 13<0x0A> in the vocab listing format id<token>.", "Which token id is the newline?"),
])
def test_tokenizer_marks_as_letters_bars_or_the_topic_are_fine(text, prompt):
    assert "token_pieces" not in codes(text, prompt=prompt, finish_reason="stop")


@pytest.mark.parametrize(("text", "prompt"), [
    ("Theskylooksbluebecausesunlightisscatteredbythemoleculesoftheair.Bluelighthasashorterwavelength.",
     "Why is the sky blue?"),
    ("Lecielestbleuparcequelalumièredusoleilestdiffuséeparlesmoléculesdelair.", "Pourquoi le ciel est-il bleu ?"),
    ("Elcieloesazulporquelaluzdelsolsedispersaenlaatmósferayelazulsedispersamás.", "¿Por qué el cielo es azul?"),
])
def test_words_run_together_with_no_spaces(text, prompt):
    verdict = assess(text, prompt=prompt, finish_reason="stop")
    assert verdict.garbage and "word_salad" in verdict.codes, verdict.to_dict()


@pytest.mark.parametrize(("text", "prompt"), [
    ("Das Wort Donaudampfschifffahrtsgesellschaftskapitän ist lang, ebenso "
     "Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz.", "Nenne lange Wörter."),
    ("Het woord kindercarnavalsoptochtvoorbereidingswerkzaamheden is erg lang.", "Noem een lang woord."),
    ("Pitkä sana: lentokonesuihkuturbiinimoottoriapumekaanikkoaliupseerioppilas.", "Kerro pitkä sana."),
    ("The longest English word is pneumonoultramicroscopicsilicovolcanoconiosis, a lung disease.", "Longest word?"),
    ("Follow #thisisthebesthashtagintheworld or https://example.com/thisisaverylongpathnamewithwords now.",
     "Where can I follow you?"),
    ("The sequence atgcgtacgttagcctaggctaacgttagcatcgatcgg codes for it; the key is "
     "dGhpc2lzYXRlc3RzdHJpbmdmb3JiYXNlNjQ.", "Show the data."),
])
def test_compounds_long_words_tags_and_data_are_not_run_together(text, prompt):
    assert "word_salad" not in codes(text, prompt=prompt, finish_reason="stop")


Q, B = '"', "\\"  # a quote mark and a backslash, to write escaped text plainly


@pytest.mark.parametrize("text", [
    "It&#39;s blue because light &amp; air interact: the &quot;Rayleigh&quot; effect scatters blue light.",
    f"Here are the steps:{B}n1. Preheat the oven.{B}n2. Mix the flour and sugar.{B}n3. Bake for 25 minutes.",
    f"The sky is blue.{B}r{B}n{B}r{B}nThis is because of scattering.{B}r{B}n{B}r{B}nRed light passes through.",
    f"{B}u5929{B}u7a7a{B}u662f{B}u84dd{B}u8272{B}u7684{B}uff0c{B}u56e0{B}u4e3a{B}u5149",
    # a whole answer as a JSON string, encoded once more
    f"{Q}The sky is blue.{B}n{B}nIt{B}u2019s because of {B}{Q}Rayleigh{B}{Q} scattering.{B}nRed light passes.{Q}",
])
def test_text_escaped_twice(text):
    verdict = assess(text, prompt="Why is the sky blue?", finish_reason="stop")
    assert verdict.garbage and verdict.top_reason.code == "escaped_text", verdict.to_dict()


@pytest.mark.parametrize(("text", "prompt"), [
    (f"Open C:{B}new{B}node{B}run, then C:{B}Users{B}name{B}Documents to find it.", "Where is the file?"),
    (f"In Python `print('a{B}nb')` prints two lines: `{B}n` is a newline and `{B}t` a tab.", "What does print do?"),
    ("Write &lt;b&gt; to start bold text and &lt;/b&gt; to end it.", "How do I make text bold on a website?"),
    ("AT&T and Procter & Gamble are big companies; so is Johnson & Johnson.", "Name big US companies."),
    (f"Example:\n\n    >>> len('cafe{B}u0301')\n    5\n    >>> '{B}u2640{B}ufe0f'\n", "Show wcwidth usage."),
    (f"Call it with 'caf{B}u00e9', '{B}u2640' or '{B}u00fc' as the name to see it work.", "Show usage."),
    ("See https://x.com/?a=1&amp;b=2&amp;c=3 for the details.", "Where are the details?"),
    (f"Escaped, it reads {Q}It{B}u2019s{B}nfine{B}n{B}n{Q}: a JSON string with {B}n for each break.",
     "How is this text escaped in JSON?"),
])
def test_escapes_in_code_paths_literals_or_on_topic_are_fine(text, prompt):
    assert "escaped_text" not in codes(text, prompt=prompt, finish_reason="stop")


def test_a_token_said_twice_at_every_round_is_doubled_words():
    answer = ("The sky looks blue because sunlight is scattered by the molecules of the air, and blue light "
              "has a shorter wavelength than red light, so it is scattered much more strongly when it "
              "passes through the atmosphere on its way to our eyes.")
    words = answer.split()
    # the first token of every round written twice, rounds of 4 or 5 tokens
    stuttered = " ".join(w + " " + w if i % 5 == 0 or i % 5 == 4 else w for i, w in enumerate(words))
    assert flagged(stuttered, "doubled_words", prompt="Why is the sky blue?", finish_reason="stop")
    # Hindi doubles words on purpose (slowly, apart, sometimes...): a double every few words is style there
    hindi = ("धीरे धीरे मौसम बदल रहा है। लोग अलग अलग जगहों पर जाते हैं और कभी कभी बारिश भी होती है। बच्चे साथ "
             "साथ खेलते हैं और बार बार हँसते हैं। गाँव के लोग घर घर जाकर मिठाई बाँटते हैं।")
    assert "doubled_words" not in codes(hindi, prompt="मौसम के बारे में लिखिए।", finish_reason="stop")
    # printed values are data, not stutter; nor are a table's letters or tab-separated columns
    printed = "mask = [True True False False True True]; valid = [None None 1 2 None None]"
    assert "doubled_words" not in codes(printed, prompt="Show the mask.", finish_reason="stop")
    table = "Case folding:\n  I  |  Y  Y  Y  n\n  i  |  Y  Y  Y  n\n  x  |  n  n  n  Y\n  y  |  Y  Y  n  Y\n"
    assert "doubled_words" not in codes(table, prompt="Show the table.", finish_reason="stop")
    columns = "msgid\tmsgstr\npo\tpo\nmo\tmo\nde\tde\nfr\tfr\nes\tes\nit\tit\n"
    assert "doubled_words" not in codes(columns, prompt="List the files.", finish_reason="stop")


def test_chinese_characters_said_twice_again_and_again_are_doubled_words():
    answer = ("天空之所以是蓝色的，是因为大气中的气体分子会散射阳光。波长较短的蓝光比波长较长的红光散射得更强烈，"
              "这种现象被称为瑞利散射。")
    # one character in four, then every third span of two, written twice
    by_char = "".join(ch * (2 if k % 4 == 1 else 1) for k, ch in enumerate(answer))
    by_pair = "".join(answer[k : k + 2] * (2 if k % 6 == 2 else 1) for k in range(0, len(answer), 2))
    for text in (by_char, by_pair):
        verdict = assess(text, prompt="为什么天空是蓝色的？", finish_reason="stop")
        assert verdict.garbage and "doubled_words" in verdict.codes, text
    # Chinese's own doubles (kinship words, AABB adverbs) and Japanese or Korean mimetic words are fine
    for text, prompt in (
        ("我的妈妈和爸爸每天都很忙。哥哥和姐姐常常帮妈妈做饭，弟弟和妹妹天天去上学。周末我们高高兴兴地去公园，"
         "看看花，说说笑笑，干干净净的小路上人人都很开心。", "写一段话。"),
        ("キラキラ光る星を見て、ドキドキしました。いろいろな人がそろそろ帰ります。ますます楽しくなりました。",
         "書いてください。"),
        ("별이 반짝반짝 빛나고 아이들이 깡충깡충 뛰어요. 나비가 훨훨 날아요.", "써 주세요."),
    ):
        assert "doubled_words" not in codes(text, prompt=prompt, finish_reason="stop"), text


def test_a_rounds_tokens_written_twice_here_and_there_is_doubled_words():
    answer = ("The sky looks blue because sunlight is scattered by the molecules of the air. Blue light has a "
              "shorter wavelength than red light, so it is scattered much more strongly, a process called "
              "Rayleigh scattering.")
    spans = answer.split()
    # rounds of 3 words, every third one written twice, as a commit that replays a round's tokens
    chunks = [spans[i : i + 3] for i in range(0, len(spans), 3)]
    twice = " ".join(" ".join(chunk * (2 if k % 3 == 1 else 1)) for k, chunk in enumerate(chunks))
    verdict = assess(twice, prompt="Why is the sky blue?", finish_reason="stop")
    assert verdict.garbage and "doubled_words" in verdict.codes, twice
    assert not assess(answer, prompt="Why is the sky blue?", finish_reason="stop").garbage
    # emphasis once, items that share their first words, and a path said twice are fine
    for text in (
        "Go team! Go team! We won the final, and the whole town came out to celebrate with us tonight.",
        "The fonts: Sans, Sans Bold, Sans Bold Oblique, Sans Mono, Sans Mono Bold, Sans Mono Bold Oblique, "
        "Serif, Serif Bold, Serif Bold Italic, Serif Condensed, Serif Condensed Bold.",
        "Clone https://github.com/pydantic/pydantic and https://github.com/fastapi/fastapi, then read "
        "the docs at https://docs.pydantic.dev/latest/ and https://fastapi.tiangolo.com/tutorial/ first.",
    ):
        assert "doubled_words" not in codes(text, prompt="Tell me.", finish_reason="stop"), text


def test_compression_ratio_flags_long_repetition_as_a_soft_signal():
    text = "Status: all systems nominal and running; " * 40
    reasons = {r.code: r for r in assess(text, finish_reason="length").reasons}
    assert reasons["compression_ratio"].severity == "soft"


def test_truncated_text_is_not_garbage_by_itself():
    verdict = assess(
        "Photosynthesis is the process by which plants convert light energy into", finish_reason="length"
    )
    assert not verdict.garbage and verdict.truncated
    assert verdict.codes == ["truncated"]
    assert verdict.summary() == "✓ truncated"


# --------------------------------------------------------------------------------------------
# Quiet on legitimate text


CLEAN = [
    ("Hello!", STORY_PROMPT, "stop"),
    ("Yes.", "Is the sky blue?", "stop"),
    ("42", "What is 6*7?", "stop"),
    ("Paris", "Capital of France?", "stop"),
    ("Hi there! How can I help?", "hi", "stop"),
    ("No", "Is 9 prime? yes or no", "stop"),
    ("Sure! 😊 Have a great day! 🎉", "Say bye", "stop"),
    (
        "Docs: https://example.com/a/b?x=1&y=2#frag and http://localhost:8000/v1/chat/completions",
        "links?",
        "stop",
    ),
    ("The café served crème brûlée; a naïve choice, perhaps, but delicious.", "Describe dessert.", "stop"),
    ("In Mandarin the concept is called “关系” (guānxi), roughly 'connections'.", "What is guanxi?", "stop"),
    ("Its name in Chinese is “长城”.", "What is the Great Wall called locally?", "stop"),
    (
        "$E = mc^2$, and for a photon $E = h\\nu$; with $\\lambda = c/\\nu$ we get $E = hc/\\lambda$.",
        "E=mc^2?",
        "stop",
    ),
    ("Let ε > 0 and δ = ε/2. Then |f(x) − f(a)| < ε whenever |x − a| < δ.", "continuity proof", "stop"),
    (
        "\n".join(
            f"- Step {i}: {v} the {o}."
            for i, (v, o) in enumerate(
                [
                    ("Open", "lid"),
                    ("Fill", "tank"),
                    ("Close", "valve"),
                    ("Start", "pump"),
                    ("Check", "gauge"),
                    ("Log", "reading"),
                    ("Stop", "pump"),
                    ("Drain", "line"),
                ],
                1,
            )
        ),
        "Procedure?",
        "stop",
    ),
    (
        "| Item | In stock | Ships |\n|---|---|---|\n| A | Yes | Yes |\n| B | Yes | Yes |\n"
        "| C | Yes | Yes |\n"
        "| D | Yes | Yes |\n| E | No | No |",
        "stock table",
        "stop",
    ),
    (
        '[{"type": "point", "x": 0, "y": 0}, {"type": "point", "x": 1, "y": 0},'
        ' {"type": "point", "x": 1, "y": 1},'
        ' {"type": "point", "x": 0, "y": 1}]',
        "square corners as JSON",
        "stop",
    ),
    (
        "```java\npublic class A {\n  void f() {\n    if (x) {\n      for (;;) {\n      }\n"
        "    }\n  }\n}\n```",
        "Java nesting",
        "stop",
    ),
    (
        "```python\nassert f(1) == 1\nassert f(2) == 1\nassert f(3) == 2\nassert f(4) == 3\n"
        "assert f(5) == 5\n```",
        "tests for fib",
        "stop",
    ),
    (
        "Glory, glory, hallelujah!\nGlory, glory, hallelujah!\nGlory, glory, hallelujah!\n"
        "His truth is marching on.",
        "Sing the chorus of the Battle Hymn of the Republic.",
        "stop",
    ),
    (
        "Let it be, let it be, let it be, let it be\nWhisper words of wisdom, let it be.",
        "Quote the Beatles song chorus.",
        "stop",
    ),
    ("你好！很高兴认识你。", "用一句话打招呼。", "stop"),
    ("Натрий — химический элемент с символом Na.", "Что такое натрий?", "stop"),
    ("東京は日本の首都です。", "日本の首都は？", "stop"),
    ("¡Claro! Aquí tienes: 1) pan, 2) leche, 3) huevos.", "Lista de compras corta.", "stop"),
    ("Übersetzung: 'Guten Morgen' heißt 'Good morning'.", "Übersetze 'Guten Morgen' ins Englische.", "stop"),
    (
        "Chinese: 我爱你\nJapanese: 愛してる\nKorean: 사랑해\nRussian: Я тебя люблю",
        "How do you say I love you in Chinese, Japanese, Korean and Russian?",
        "stop",
    ),
    ("Hello\nBonjour\nHola\nПривет\n你好", "Translate hello into five languages.", "stop"),
    ("User: admin\nPassword: admin", "What are the default router credentials?", "stop"),
    (
        "Alice: Hi Bob!\nBob: Hi Alice, how are you?",
        "Write a two-line dialogue between Alice and Bob.",
        "stop",
    ),
    ("<think>\nShort greeting.\n</think>\n\nHello!", STORY_PROMPT, "stop"),
    ("Yes, I will.", "Will you help me?", "stop"),
    (
        "Read more at https://ja.wikipedia.org/wiki/東京 or www.example.jp/東京.",
        "Where can I read more?",
        "stop",
    ),
    ("It depends on what you mean by", "finish this phrase", "length"),
]


@pytest.mark.parametrize(("text", "prompt", "finish"), CLEAN)
def test_quiet_on_legitimate_text(text, prompt, finish):
    verdict = assess(text, prompt=prompt, finish_reason=finish)
    assert not verdict.garbage, verdict.to_dict()


MORE_CLEAN = [
    (
        "Mix the dry ingredients:\n- Add 1 cup of flour to the bowl.\n- Add 1 cup of sugar to the bowl.\n"
        "- Add 1 cup of cocoa to the bowl.\n- Add 1 cup of oats to the bowl.\n"
        "- Add 1 cup of milk to the bowl.",
        "Recipe?",
    ),
    ("Roles:\nAdmin\nUser\nGuest", "What roles exist?"),
    ("No, no, no, no! Don't do that.", "React"),
    ("Tick-tock, tick-tock, tick-tock goes the clock.", "Describe a clock"),
    ("Yes it is", "Is Paris in France?"),
    ("The EOS token </s> tells the model to stop.", "What does the EOS token do in Llama 2?"),
    ("**User:** the person using the app.\n**Admin:** manages accounts.", "Define the roles."),
    ("Q: What is 2+2?\nA: 4", "Give me a Q&A example"),
    ("😂😂😂", "React to a joke with emoji"),
    ("x = 1\ny = 1\nz = 1", "three variables equal to one"),
    ("Step 1: Preheat oven.\nStep 2: Mix.\nStep 3: Bake.\nStep 4: Cool.\nStep 5: Serve.", "Steps?"),
    ("Good question!\n\n**Step 1:** Identify.\n**Step 2:** Write.\n**Step 3:** Solve.\n\nSo x = 5.", "solve"),
    ("Hello\r\nWorld\r\n", "Two lines"),
    (
        "Here is an example:\n\n**User:** How do I reset my password?\n"
        "**Assistant:** Click Forgot password on the login page.",
        "Show how a support bot should answer",
    ),
    ("AI: Artificial intelligence, the field of making machines smart.", "Define AI"),
    ("Tables:\norder\nuser\nproduct", "Which tables does the shop schema have?"),
    ("这是我の最爱。", "你最喜欢什么？"),
]

MORE_GARBAGE = [
    (
        "Here are some facts:\n1. The sun is a star.\n2. The sun is a star.\n3. The sun is a star.\n"
        "4. The sun is a star.\n5. The sun is a star.\n6. The sun is a star.",
        "Facts?",
        "length",
    ),
    ("Hello! How can I assist you today?\n\nuser\nHi\n\nassistant\nHello!", "Say hi", "stop"),
    ("Hello!\r\nuser\r\nhi\r\nassistant\r\nyo", "Say hi", "stop"),
    ("Hello!\n\nUser: What's up?", "Say hi", "stop"),
    ("2 + 2 = 4. 2 + 2 = 4. 2 + 2 = 4. 2 + 2 = 4. 2 + 2 = 4.", "What is 2+2?", "length"),
    ("Here's the answer: 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4", "What is 2+2?", "length"),
    ("OK OK OK OK OK OK OK OK OK OK OK OK", "Confirm", "length"),
    ("我是一个AI助手，我可以帮助你。我可以帮助你。我可以帮助你。我可以帮助你。", "你是谁？", "length"),
    ("Madrid es la capital de España y 它是一个美丽的城市。", "¿Cuál es la capital de España?", "stop"),
    ("Sure! Here is the answer: 答案是", "What is 2+2?", "stop"),
    ("Step 1: Step 1: Step 1: Step 1: Step 1: Step 1:", "Steps?", "length"),
    ("To install:\n\n```bash\npip install x\n```<|endoftext|><|im_start|>system", "Install?", "stop"),
    (".", "Explain recursion.", "stop"),
]


@pytest.mark.parametrize(("text", "prompt"), MORE_CLEAN)
def test_quiet_on_more_legitimate_shapes(text, prompt):
    verdict = assess(text, prompt=prompt, finish_reason="stop")
    assert not verdict.garbage, verdict.to_dict()


@pytest.mark.parametrize(("text", "prompt", "finish"), MORE_GARBAGE)
def test_flags_more_failure_shapes(text, prompt, finish):
    verdict = assess(text, prompt=prompt, finish_reason=finish)
    assert verdict.garbage, verdict.to_dict()


def test_mojibake_is_found_without_ftfy(monkeypatch):
    monkeypatch.setitem(sys.modules, "ftfy", None)  # import ftfy now raises ImportError
    verdict = assess("L'Ã©tÃ© est chaud.")
    assert verdict.garbage and verdict.top_reason.code == "mojibake"
    assert "should read 'é'" in verdict.top_reason.detail
    assert not assess("L'été est chaud, café crème.").garbage


def test_code_with_template_tokens_is_fine_when_asked_about_templates():
    text = "A turn looks like:\n\n```\n<|im_start|>user\nHi<|im_end|>\n```"
    assert not assess(text, prompt="Show the ChatML format.").garbage


def test_template_tokens_quoted_in_backticks_or_in_code_for_a_model_prompt_are_fine():
    text = "vLLM stops when it sees `<|im_end|>` in the output."
    assert not assess(text, prompt="How does vLLM know when to stop?", finish_reason="stop").garbage
    code = '```python\nprompt = "<|im_start|>user\\n" + q + "<|im_end|>"\n```'
    assert not assess(code, prompt="Write Python that builds a Qwen prompt", finish_reason="stop").garbage


def test_repetition_asked_for_is_fine():
    assert not assess("hello " * 10, prompt="Repeat the word hello 10 times.", finish_reason="stop").garbage


@pytest.mark.parametrize(("prompt", "count"), [
    ("Say hello 20 times.", 20),
    ("Repeat the word hello fifty times, please", 50),
    ("重复 hello 30次", 30),
])
def test_repetition_as_often_as_the_prompt_asks_is_fine_but_not_more_nor_other_words(prompt, count):
    for text in ("hello " * count, "Hello! " * count, "".join(f"{i}. hello\n" for i in range(1, count + 1))):
        assert not assess(text.strip(), prompt=prompt, finish_reason="stop").garbage, text[:40]
    # three times what was asked, or a phrase the prompt never said, is a loop again
    assert assess("hello " * (3 * count), prompt=prompt, finish_reason="stop").garbage
    assert assess("the cat " * count, prompt=prompt, finish_reason="stop").garbage
    # with no count, the old bar: a repetition prompt allows a dozen or so, not 40
    assert assess("hello " * 40, prompt="Repeat the word hello.", finish_reason="stop").garbage


def test_the_counts_a_repetition_prompt_names():
    from ddtree_diag.checks.quality.context import Context

    def count(prompt: str) -> int:
        return Context(prompt, truncated=False).repeat_count

    assert count("Say hello 20 times.") == 20
    assert count("Count from 1 to 1,000 in words") == 1000
    assert count("Say it twice, then repeat it a dozen times") == 12
    assert count("Repeat after me 5x: ok") == 5
    assert count("List all the events of 2024") == 0  # a year is no count
    assert count("repeat 3.5 times") == 0
    assert count("Say hello 20 times? No: say it once.") == 20  # the largest named
    assert count("Explain why 20 is an even number") == 0  # no repetition prompt


def test_same_text_in_its_own_language_is_fine_but_not_in_another():
    chinese = "北京是中国的首都。"
    assert not assess(chinese, prompt="中国的首都是哪里？").garbage
    mixed = "The capital of China is Beijing, 北京是中国的首都 and a big city."
    assert assess(mixed, prompt="What is the capital of China?").garbage is False  # the prompt names China
    assert assess(mixed, prompt="What is the capital of that country?").garbage


# --------------------------------------------------------------------------------------------
# API


def test_verdict_round_trips_through_dict():
    verdict = assess(STORY_THINKING, prompt=STORY_PROMPT, finish_reason="length", thinking=True)
    data = verdict.to_dict()
    assert set(data) == {"garbage", "score", "truncated", "reasons"}
    for reason in data["reasons"]:
        assert {"code", "detail", "evidence", "severity"} <= set(reason)
        assert reason["code"] in REASON_CODES
        assert reason["severity"] in ("hard", "soft", "info")
    json.dumps(data)  # plain JSON
    again = Verdict.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data


def test_reason_unpacks_as_code_detail_evidence():
    reason = assess("Hello,", finish_reason="stop").reasons[0]
    code, detail, evidence = reason
    assert (code, evidence) == ("premature_stop", "Hello,")
    assert reason[1] == detail
    assert Reason.from_dict({"code": "x", "detail": "d", "evidence": "e", "severity": "hard"}).weight >= 0.5


def test_summary_and_mark():
    bad = assess("the the the the the the", finish_reason="length")
    assert bad.mark == "✗" and bad.summary().startswith("✗ token_loop: ")
    good = assess("Hello!", finish_reason="stop")
    assert good.mark == "✓" and good.summary() == "✓"
    assert len(bad.summary(width=20)) == 20 and bad.summary(width=20).endswith("…")


def test_summarize_a_stored_verdict_for_a_table_cell():
    assert summarize(None) == "—"
    assert summarize(assess("Hello!", finish_reason="stop").to_dict()) == "✓"
    assert summarize(assess("Hi there, how", finish_reason="length").to_dict()) == "✓ truncated"
    cell = summarize(assess(STORY_THINKING, prompt=STORY_PROMPT, thinking=True).to_dict(), width=40)
    assert cell.startswith("✗ degenerate_enumeration") and len(cell) <= 40


def test_assess_result_stores_the_verdict_on_the_probe_result():
    case = ProbeCase(
        prompt_id="hello",
        messages=[{"role": "user", "content": STORY_PROMPT}],
        enable_thinking=False,
        max_tokens=48,
    )
    result = ProbeResult(case=case, output="Hello,", finish_reason="stop", completion_tokens=3)
    verdict = assess_result(result)
    assert verdict.garbage and result.quality == verdict
    # and the record still round-trips with it
    assert ProbeResult.from_dict(result.to_dict()).quality == result.quality
    failed = ProbeResult(case=case, status="transport_error", error="refused")
    assert assess_result(failed) is None and failed.quality is None


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300), st.sampled_from([None, "stop", "length"]), st.sampled_from([None, True, False]))
def test_any_text_gives_a_consistent_verdict(text, finish, thinking):
    verdict = assess(text, prompt="Explain it.", finish_reason=finish, thinking=thinking)
    assert 0.0 <= verdict.score <= 1.0
    assert verdict.garbage == (verdict.score >= GARBAGE_THRESHOLD)
    assert all(r.code in REASON_CODES for r in verdict.reasons)
    assert assess(text, prompt="Explain it.", finish_reason=finish, thinking=thinking) == verdict


def test_long_text_with_a_loop_late_in_it():
    rng = random.Random(3)
    vocab = [
        "model",
        "draft",
        "target",
        "token",
        "verify",
        "accept",
        "reject",
        "tree",
        "budget",
        "round",
        "cache",
        "layer",
        "state",
        "prompt",
        "answer",
        "server",
        "client",
        "latency",
        "throughput",
        "batch",
        "kernel",
        "memory",
        "bandwidth",
        "queue",
        "stream",
        "chunk",
        "header",
        "request",
        "response",
        "metric",
        "counter",
        "gauge",
        "histogram",
        "window",
    ]
    sentences = []
    for _ in range(2500):
        words = rng.sample(vocab, rng.randint(5, 12))
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
    prose = " ".join(sentences)
    assert len(prose) > 100_000
    assert not assess(prose, finish_reason="stop").garbage
    looped = prose[:60_000] + " and then the model said " + "over and over " * 30 + prose[60_000:90_000]
    assert assess(looped, finish_reason="stop").garbage


@pytest.mark.e2e
def test_import_is_light():
    code = (
        "import sys, ddtree_diag.checks.quality\n"
        "heavy = [m for m in ('torch', 'transformers', 'httpx', 'ftfy', 'rich') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert out.stdout.strip() == ""


def _corpus_rows() -> list[dict]:
    rows = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return rows


def test_every_span_points_at_its_evidence():
    keys = ("prompt", "finish_reason", "completion_tokens", "max_tokens", "thinking", "reasoning")
    rows = [*_corpus_rows(), {"text": "<think>\nok\n</think>\n\nParis, 巴黎是<|im_end|>", "thinking": True}]
    checked = 0
    for row in rows:
        for reason in assess(row["text"], **{k: row.get(k) for k in keys}).reasons:
            source = row["text"] if reason.source == "text" else row["reasoning"]
            if reason.span is None or not reason.evidence:
                continue
            start, end = reason.span
            assert 0 <= start <= end <= len(source)
            assert source[start:].startswith(reason.evidence[: end - start]), (reason, row["text"][:60])
            checked += 1
    assert checked > 150


def test_the_labelled_clean_corpus_stays_clean():
    """Every clean answer of the corpus (greetings, lists, code, maths, translations, technical
    answers full of jargon: "repository", "metadata", "multipart") passes."""
    keys = ("prompt", "finish_reason", "completion_tokens", "max_tokens", "thinking", "reasoning")
    rows = [row for row in _corpus_rows() if row["label"] == "clean"]
    verdicts = [(row["note"], assess(row["text"], **{k: row.get(k) for k in keys})) for row in rows]
    assert [(note, verdict.codes) for note, verdict in verdicts if verdict.garbage] == []
    assert sum(row["note"].startswith("technical answer") for row in rows) >= 8


def test_an_address_said_again_and_again_is_still_a_loop():
    # an IPv6 / MAC address reads as one token (its groups repeat by design); the address
    # itself repeated, or a run of groups longer than any address, is a loop as before
    for text in ("The mask is " + "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff " * 12,
                 "The address is " + "ffff:" * 40, "Interfaces: " + "00:1c:2b:4d:5e:6f, " * 15):
        codes = assess(text, prompt="What is the netmask?", finish_reason="stop").codes
        assert {"phrase_loop", "token_loop"} & set(codes), (text, codes)


def test_numbers_in_a_closed_literal_are_data_but_an_open_run_is_a_loop():
    zeros = ", ".join(["0"] * 24)
    assert not assess(f"The buffer starts as [{zeros}] and fills up.", prompt="x", finish_reason="stop").garbage
    assert not assess(f"The vector ({zeros}) is all zeros.", prompt="x", finish_reason="stop").garbage
    for text in (f"The buffer starts as [{zeros}, {zeros}", f"The values are {zeros}, {zeros} and more."):
        assert "phrase_loop" in assess(text, prompt="x", finish_reason="stop").codes, text


def test_corpus_is_large_and_labelled():
    rows = _corpus_rows()
    labels = [r["label"] for r in rows]
    assert labels.count("clean") >= 150 and labels.count("garbage") >= 100
    assert all({"text", "prompt", "finish_reason", "label", "note"} <= set(r) for r in rows)
    texts = {r["text"] for r in rows if r["label"] == "garbage"}
    assert STORY_THINKING in texts and "Hello," in texts


# --------------------------------------------------------------------------------------------
# Faults planted into one healthy answer: each must be caught, the answer itself must pass.

_BASE = (
    "Speculative decoding speeds up inference by letting a small draft model propose several tokens, "
    "which the target model verifies in one forward pass. Accepted tokens are kept, and at the first "
    "mismatch the target's own token is used. Because of this, the output at temperature zero is "
    "identical to what the target alone would produce."
)
_BASE_PROMPT = "Explain speculative decoding in a paragraph."

PLANTED = {
    "template token": _BASE[:150] + "<|im_end|>" + _BASE[150:],
    "replacement char": _BASE[:200] + "\ufffd" + _BASE[200:],
    "escape char": _BASE[:120] + "\x1b" + _BASE[120:],
    "Chinese clause": _BASE[:180] + " 目标模型会验证这些令牌 " + _BASE[180:],
    "Russian clause": _BASE[:180] + " которые проверяет " + _BASE[180:],
    "answer said twice": _BASE + " " + _BASE,
    "stutter": _BASE[:100] + " the the the the the " + _BASE[100:],
    "stop on 'and the'": _BASE[:-60] + " and the",
    "user turn": _BASE + "\n\nuser\nCan you give an example?",
    "Human/Assistant": _BASE + "\n\n### Human: thanks\n### Assistant:",
    "mojibake": _BASE + " CafÃ© example.",
    "unterminated think": "<think>\n" + _BASE,
    "numbering loop": _BASE[:150] + " 1. 1. 1. 1. " + _BASE[150:],
    "tail loop": _BASE + " " + "Because of this, the output at temperature zero is identical. " * 4,
}


def test_the_healthy_base_answer_passes():
    assert assess(_BASE, prompt=_BASE_PROMPT, finish_reason="stop").reasons == []


@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_each_planted_fault_is_caught(fault):
    verdict = assess(PLANTED[fault], prompt=_BASE_PROMPT, finish_reason="stop")
    assert verdict.garbage, (fault, verdict.to_dict())


def test_same_verdicts_without_the_regex_module(monkeypatch):
    """The single-file build has no `regex` (compiled): the stdlib fallback must agree on the corpus."""
    from ddtree_diag.checks.quality import patterns

    keys = ("prompt", "finish_reason", "completion_tokens", "max_tokens", "thinking", "reasoning")
    rows = _corpus_rows()
    rows.append({"text": "The answer is Париж, 东京 and Αθήνα.", "prompt": "Name three capitals."})

    def verdicts() -> list[tuple[bool, tuple[str, ...]]]:
        out = []
        for row in rows:
            verdict = assess(row["text"], **{k: row.get(k) for k in keys})
            out.append((verdict.garbage, tuple(sorted(verdict.codes))))
        return out

    patterns.script_run_re.cache_clear()
    with_regex = verdicts()
    monkeypatch.setitem(sys.modules, "regex", None)  # import regex -> ImportError
    patterns.script_run_re.cache_clear()
    try:
        without = verdicts()
    finally:
        patterns.script_run_re.cache_clear()
    assert without == with_regex
    assert with_regex[-1][0] is True  # the planted script mix is caught either way


def test_reason_codes_come_from_one_registry_and_the_readme_shows_it():
    """The code list, the loop subset the findings use, and the README table are one registry."""
    from ddtree_diag.checks import findings
    from ddtree_diag.checks.quality import registry
    from tests.support.processes import ROOT

    assert tuple(r.code for r in registry.REGISTRY) == registry.REASON_CODES
    assert len(set(registry.REASON_CODES)) == len(registry.REASON_CODES)
    assert findings.LOOP_CODES is registry.LOOP_CODES and "token_loop" in findings.LOOP_CODES
    assert registry.readme_table() in (ROOT / "README.md").read_text(encoding="utf-8")
    # every code a signal can emit is registered (the codes appear in the signal modules)
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "ddtree_diag/checks/quality").glob("*.py")
                      if p.name != "registry.py")
    sources += (ROOT / "ddtree_diag/checks/likelihood.py").read_text(encoding="utf-8")  # the --score-with codes
    assert all(f'"{code}"' in sources for code in registry.REASON_CODES)


def test_detection_runs_from_the_registry():
    """assess runs what the families list: every family module lists its detectors in DETECTORS,
    each reads a known scope, and every code names its family."""
    import inspect

    from ddtree_diag.checks.quality import context, registry

    names = {family.__name__.rsplit(".", 1)[-1] for family in registry.FAMILIES}
    assert {r.family for r in registry.REGISTRY} <= names | {"likelihood"}
    assert len(set(registry.DETECTORS)) == len(registry.DETECTORS)
    for detector in registry.DETECTORS:
        assert context.scope_of(detector) in context.SCOPES
        assert list(inspect.signature(detector).parameters) == ["text", "ctx"], detector.__name__
    assert {context.scope_of(d) for d in registry.DETECTORS} == set(context.SCOPES)
    # a detector's reasons depend on its text and context only, and it returns a new list
    ctx = context.Context("Say hello.", False, finish="stop").reading("1. 1. 1. 1. the the the the the")
    for detector in registry.detectors(context.ANY):
        assert detector(ctx.text, ctx) is not detector(ctx.text, ctx)

