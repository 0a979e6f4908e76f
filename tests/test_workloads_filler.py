"""The long-context filler: deterministic, prefix-shared, in the question's language, question last,
sized by a counter to within 2 % under the target (or estimated, and flagged)."""

from __future__ import annotations

import json
import math
import re
import time
from importlib import resources

import pytest

from ddtree_diag.workloads import filler
from ddtree_diag.workloads.filler import (
    LANGUAGES,
    content_text,
    detect_language,
    estimate_prompt_tokens,
    estimate_tokens,
    fill_messages,
    filler_document,
    intro_line,
)
from tests.support.timing import FILL_32K_MAX_S

pytestmark = pytest.mark.unit

QUESTIONS = {
    "en": "What is the capital of France? Answer in one word.",
    "zh": "请用一句话解释什么是光合作用。",
    "ja": "光合作用とは何か、一文で説明してください。",
    "ru": "Объясните одним предложением, что такое фотосинтез.",
    "es": "¿Cuál es la capital de Francia? Responde con una palabra.",
    "de": "Was ist die Hauptstadt von Frankreich? Antworte mit einem Wort.",
    "fr": "Quelle est la capitale de la France ? Réponds en un mot.",
}


def chat(question: str, system: str | None = "You are a helpful assistant.") -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": question}]


class Counter:
    """A stand-in tokenizer over whole prompts: counts its calls; ``per_message`` mimics a chat
    template's role markers."""

    def __init__(self, unit: str = "words", per_message: int = 5) -> None:
        self.unit = unit
        self.per_message = per_message
        self.calls = 0

    def tokens(self, text: str) -> int:
        if self.unit == "words":  # words and punctuation marks: a whitespace-split tokenizer
            return len(re.findall(r"\w+|[^\w\s]", text))
        return math.ceil(len(text) / 3.3)  # characters: works for unspaced scripts too

    def __call__(self, messages: list[dict]) -> int:
        self.calls += 1
        return 3 + sum(self.per_message + self.tokens(content_text(m.get("content"))) for m in messages)


def user_content(result: filler.FilledPrompt) -> str:
    return next(m for m in reversed(result.messages) if m["role"] == "user")["content"]


def document_of(result: filler.FilledPrompt, question: str) -> str:
    content = user_content(result)
    intro = intro_line(result.language) + "\n\n"
    assert content.startswith(intro) and content.endswith("\n\n" + question)
    return content[len(intro) : -len("\n\n" + question)]


# ---------------------------------------------------------------------------------------------
# Language detection


@pytest.mark.parametrize("language, text", list(QUESTIONS.items()))
def test_detects_the_language_of_each_supported_question(language, text):
    assert detect_language(text) == language


@pytest.mark.parametrize("text, language", [
    ("Explain how a hash map works.", "en"),
    ("把这句话翻译成英文：The weather is nice today.", "zh"),  # a Chinese instruction around English
    ("カタカナとひらがなと漢字", "ja"),
    ("東京", "zh"),  # kanji alone cannot be told from Chinese
    ("Привет, как дела?", "ru"),
    ("Straße", "de"),  # an accented letter alone decides
    ("français ça", "fr"),
    ("mañana", "es"),
    ("", "en"),
    ("1234 + 5678 = ?", "en"),  # no letters
    ("مرحبا بالعالم", "en"),  # a script without filler text: the default
    ("안녕하세요", "en"),
    ("ok", "en"),  # no common word: the default
])
def test_detection_on_mixed_short_and_foreign_text(text, language):
    assert detect_language(text) == language


def test_detection_takes_anything():
    for junk in (None, 42, ["a"], "\x00\ufffd"):
        assert detect_language(junk) == "en"


# ---------------------------------------------------------------------------------------------
# The document


@pytest.mark.parametrize("language", LANGUAGES)
def test_documents_are_deterministic_prefixes_of_each_other(language):
    small, large = filler_document(language, 3000), filler_document(language, 40_000)
    assert small and large.startswith(small)
    assert filler_document(language, 3000) == small
    assert len(small) <= 3000 and len(large) > 30_000


@pytest.mark.parametrize("language", ["en", "es", "de", "fr", "ru"])
def test_spaced_documents_end_on_a_whole_word(language):
    stream = filler_document(language, 50_000)
    for chars in (100, 1001, 7777):
        document = filler_document(language, chars)
        following = stream[len(document) : len(document) + 1]
        assert following in ("", " ", "\n"), (document[-20:], following)


@pytest.mark.parametrize("language", LANGUAGES)
def test_documents_are_clean_text(language):
    document = filler_document(language, 60_000)
    assert not re.search(r"[{}|]|\b[mfnp]:", document)  # no template syntax or gender tags left
    assert "  " not in document and "\n\n\n" not in document
    paragraphs = document.split("\n\n")
    assert len(paragraphs) > 20
    assert all(p[:1].upper() == p[:1] for p in paragraphs)  # sentences start capitalised


@pytest.mark.parametrize("language", LANGUAGES)
def test_documents_do_not_repeat_long_spans(language):
    """Drafts that copy from the prompt (n-gram, prompt lookup) would accept trivially over text
    pasted again and again. Here names and phrases recur, as in a real document, but a span of 64
    characters (15-40 tokens) almost never comes back, nor does a whole sentence."""
    document = filler_document(language, 120_000 if language not in ("zh", "ja") else 50_000)
    span = 64
    seen: set[str] = set()
    repeated = 0
    for start in range(0, len(document) - span, 7):
        piece = document[start : start + span]
        repeated += piece in seen
        seen.add(piece)
    assert repeated / len(seen) < 0.01
    sentences = re.split(r"(?<=[.。])\s*", document)
    assert len(set(sentences)) > 0.98 * len(sentences)


def test_russian_verbs_agree_with_feminine_subjects():
    spec = filler._spec("ru")
    document = filler_document("ru", 200_000)
    feminine = ["".join(v.forms[0]) for v in spec.slots["subject"] if v.gender == 1]
    masculine_verbs = ["".join(v.forms[0]) for v in spec.slots["verb"]]
    assert feminine and masculine_verbs
    for subject in feminine:
        for verb in masculine_verbs:
            assert f"{subject} {verb} " not in document
    assert any(f"{subject} " in document for subject in feminine)


def test_french_que_is_elided_before_a_vowel():
    document = filler_document("fr", 200_000)
    assert not re.search(r"\bque [aeiouéàâ]", document)
    assert "qu'un" in document  # qu'un, qu'une: the elision happens


def test_the_shipped_data_is_small_and_consistent():
    folder = resources.files("ddtree_diag").joinpath("data", "filler")
    total = 0
    for language in LANGUAGES:
        raw = folder.joinpath(f"{language}.json").read_text("utf-8")
        total += len(raw.encode())
        data = json.loads(raw)
        assert data["language"] == language and data["intro"]
        names = set(data["slots"]) | {"num", "year"}
        used = set()
        for text in data["templates"] + [v for values in data["slots"].values() for v in values]:
            used |= {m.group(1) for m in re.finditer(r"\{(\w+)(?:#\d)?\}", text)}
        assert used <= names, used - names
        assert set(data["slots"]) <= used  # no list that no template reaches
    assert total < 300_000


# ---------------------------------------------------------------------------------------------
# Filling a prompt


@pytest.mark.parametrize("language", LANGUAGES)
def test_the_question_comes_last_after_an_intro_in_its_language(language):
    question = QUESTIONS[language]
    messages = chat(question)
    result = fill_messages(messages, 1500, count_tokens=Counter("chars"))
    assert result.language == language
    assert result.messages[0] == messages[0]  # the system message is untouched
    assert len(result.messages) == len(messages)
    document = document_of(result, question)
    assert document and question not in document
    assert user_content(result).startswith(intro_line(language))
    assert messages[1]["content"] == question  # the caller's messages are not modified


def test_the_intro_says_what_to_do():
    assert intro_line("en") == "Read the following document, then answer the question after it."
    assert len({intro_line(language) for language in LANGUAGES}) == len(LANGUAGES)


def test_content_given_as_parts_keeps_its_parts_last():
    parts = [{"type": "text", "text": "Describe this picture."},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    result = fill_messages([{"role": "user", "content": parts}], 800, count_tokens=Counter("chars"))
    content = result.messages[0]["content"]
    assert content[1:] == parts
    assert content[0]["type"] == "text" and content[0]["text"].startswith(intro_line("en"))


def test_only_the_last_user_message_grows():
    messages = [{"role": "user", "content": "First question?"},
                {"role": "assistant", "content": "First answer."},
                {"role": "user", "content": "Second question?", "name": "kept"}]
    result = fill_messages(messages, 1000, count_tokens=Counter())
    assert result.messages[:2] == messages[:2]
    assert result.messages[2]["name"] == "kept"
    assert result.messages[2]["content"].endswith("\n\nSecond question?")


def test_same_inputs_give_the_same_bytes():
    def run(counter):
        return json.dumps(fill_messages(chat(QUESTIONS["de"]), 4096, count_tokens=counter).messages,
                          ensure_ascii=False).encode()

    assert run(Counter()) == run(Counter())
    assert run(None) == run(None)


@pytest.mark.parametrize("counter", [Counter("words"), Counter("chars"), None], ids=["words", "chars", "estimate"])
def test_smaller_fills_are_prefixes_of_larger_ones(counter):
    question = QUESTIONS["en"]
    documents = [document_of(fill_messages(chat(question), size, count_tokens=counter), question)
                 for size in (2048, 8192, 32768)]
    assert documents[1].startswith(documents[0]) and documents[2].startswith(documents[1])
    assert len(documents[0]) < len(documents[1]) < len(documents[2])


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("target", [300, 2048, 8192, 32768])
def test_calibration_lands_within_two_percent_under_the_target(language, target):
    counter = Counter("words" if language not in ("zh", "ja") else "chars", per_message=7)
    result = fill_messages(chat(QUESTIONS[language]), target, count_tokens=counter)
    assert not result.estimated
    assert result.tokens == counter(result.messages)  # the reported size is the measured one
    assert target * 0.98 <= result.tokens <= target
    assert counter.calls <= 1 + 1 + filler.MAX_ROUNDS


def test_a_tokenizer_far_from_the_estimate_is_still_reached():
    """A counter 3x denser than the estimate (one token per character): the first guess is far
    off, the rescaling gets there."""
    counter = Counter("chars")
    counter.tokens = len
    result = fill_messages(chat(QUESTIONS["en"]), 5000, count_tokens=counter)
    assert 4900 <= result.tokens <= 5000 and not result.estimated


def test_without_a_counter_the_size_is_estimated_and_flagged():
    result = fill_messages(chat(QUESTIONS["ru"]), 4096)
    assert result.estimated and result.language == "ru"
    assert result.tokens == estimate_prompt_tokens(result.messages)
    assert 4096 * 0.98 <= result.tokens <= 4096


def test_a_counter_that_cannot_count_falls_back_to_the_estimate():
    answers = iter([1000, None])  # the server stops answering after the base count

    def flaky(messages):
        return next(answers, None)

    for counter in (lambda messages: None, flaky, lambda messages: "junk", lambda messages: True):
        result = fill_messages(chat(QUESTIONS["en"]), 3000, count_tokens=counter)
        assert result.estimated
        assert result.tokens == estimate_prompt_tokens(result.messages)


def test_a_prompt_already_over_the_target_is_left_as_it_is():
    messages = chat("word " * 400)
    result = fill_messages(messages, 50, count_tokens=Counter())
    assert result.messages == messages and result.document_chars == 0
    assert result.tokens == Counter()(messages) and not result.estimated
    estimated = fill_messages(messages, 50)
    assert estimated.messages == messages and estimated.estimated


def test_the_language_can_be_chosen():
    result = fill_messages(chat("What is 2 + 2?"), 1000, language="ja")
    assert result.language == "ja"
    assert user_content(result).startswith(intro_line("ja"))


@pytest.mark.parametrize("messages, target, language", [
    ([{"role": "system", "content": "Only a system message."}], 1000, None),
    ([], 1000, None),
    (chat("Hi"), 0, None),
    (chat("Hi"), -5, None),
    (chat("Hi"), True, None),
    (chat("Hi"), 1000, "xx"),
])
def test_what_cannot_be_filled_is_refused(messages, target, language):
    with pytest.raises(ValueError):
        fill_messages(messages, target, language=language)


def test_estimates_by_script():
    assert estimate_tokens("") == 0
    assert estimate_tokens("abcd" * 100) == 100
    assert estimate_tokens("汉字" * 75) == 100
    assert estimate_tokens("абв" * 100) == 100
    assert estimate_prompt_tokens([{"role": "user", "content": "abcd" * 10}]) == 10 + 4 + 3


@pytest.mark.timing
def test_a_32k_fill_is_built_fast():
    start = time.perf_counter()
    counter = Counter()
    result = fill_messages(chat(QUESTIONS["en"]), 32768, count_tokens=counter)
    estimated = fill_messages(chat(QUESTIONS["zh"]), 32768)
    elapsed = time.perf_counter() - start
    assert result.tokens > 32000 and estimated.tokens > 32000
    assert counter.calls <= 5  # the base count and a few rescalings
    assert elapsed < FILL_32K_MAX_S
