"""Long-context prompts: a deterministic document in the prompt's language, put before its question.

A long-context probe needs a prompt of a given size in tokens. ``fill_messages`` turns the last user
message into an intro line, a document, and the original question last. The document is composed
sentence by sentence from the templates and word lists in ``ddtree_diag/data/filler/`` (one JSON
file a language), driven by a fixed-seed generator, so:

- the same inputs give the same bytes, on every machine and Python version (the generator is our
  own SplitMix64, not ``random``);
- a shorter document is a prefix of a longer one in the same language: runs at 2k and 8k tokens
  share their prefix-cache entries;
- the text does not repeat verbatim. A pasted paragraph repeated to 32k tokens would let n-gram /
  prompt-lookup drafts copy whole spans out of the prompt and report acceptance no real document
  gives; composed sentences repeat only short phrases, as real text does.

Sizing: with ``count_tokens`` (the server's own tokenizer, ``backends.tokenize.token_counter``) the
prompt is measured and the document rescaled until the total lands within 1 % under the target
(a few counts); without it, or when the server cannot count, tokens are estimated from characters
per script and the result says so (``estimated``).
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

LANGUAGES = ("en", "zh", "es", "de", "fr", "ru", "ja")
DEFAULT_LANGUAGE = "en"

# Aim within 1 % under the target (the promise is 2 %), or MIN_SLACK tokens for small targets:
# the document is cut at a word, and a word is a few tokens.
TOLERANCE = 0.01
MIN_SLACK = 4
MAX_ROUNDS = 6  # counts after the base one; a linear tokenizer needs two or three

# Rough characters per token of current BPE tokenizers (Llama 3, Qwen 2.5, Mistral): English ~4,
# Russian ~3, Chinese/Japanese ~1.5. Only used where the server cannot count.
CHARS_PER_TOKEN_CJK = 1.5
CHARS_PER_TOKEN_CYRILLIC = 3.0
CHARS_PER_TOKEN_OTHER = 4.0
# A chat template adds a few tokens a message (role markers) and the assistant's opening.
MESSAGE_OVERHEAD = 4
REPLY_OVERHEAD = 3

Messages = list[dict[str, Any]]
TokenCounter = Callable[[Messages], "int | None"]


@dataclass(frozen=True)
class FilledPrompt:
    """A prompt grown to a size: ``tokens`` is measured by the server, or estimated when
    ``estimated``. ``document_chars`` is 0 when the prompt was already at or over the target
    (then ``messages`` are the original ones)."""

    messages: Messages
    tokens: int
    estimated: bool
    language: str
    document_chars: int = 0
    target_tokens: int = 0


# ---------------------------------------------------------------------------------------------
# Language detection: script first, then common words.

_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_CYRILLIC = re.compile(r"[\u0400-\u04ff]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f]")
_WORD = re.compile(r"[^\W\d_]+")

_COMMON_WORDS = {
    "en": "the and of is that what how why you your with for are was this which who please does can from it be "
          "have write explain tell would should could there their about",
    "es": "el la los las de que y en es por para con una del qué cómo cuál está son se lo al como pero más escribe "
          "explica dime puedes sobre este esta",
    "de": "der die das und ist nicht ein eine ich sie mit für auf dem den des wie was warum welche bitte zu von es "
          "sind auch schreibe erkläre kannst über diese",
    "fr": "le la les des est et une un du que qui pour dans avec sur pas ce cette quel quelle comment pourquoi vous "
          "je il sont écris explique au aux peux",
}
STOPWORDS = {lang: frozenset(words.split()) for lang, words in _COMMON_WORDS.items()}
# Letters one language uses and the others here do not (é is both Spanish and French: left out).
MARKS = {"es": "ñ¿¡áíóú", "de": "äöüß", "fr": "çèêëàâîïôûùœ"}
CJK_WEIGHT = 3  # one CJK character carries about as much as three Latin letters


def detect_language(text: str) -> str:
    """The language of a prompt among ``LANGUAGES``: CJK (Japanese when it has kana), Cyrillic
    (Russian), or Latin (English, Spanish, German, French by common words and accented letters).
    Anything else, or a tie, is English."""
    if not isinstance(text, str) or not text:
        return DEFAULT_LANGUAGE
    han = len(_HAN.findall(text))
    kana = len(_KANA.findall(text))
    cyrillic = len(_CYRILLIC.findall(text))
    latin = len(_LATIN.findall(text))
    cjk = (han + kana) * CJK_WEIGHT
    if cjk == cyrillic == latin == 0:
        return DEFAULT_LANGUAGE
    if cjk >= cyrillic and cjk >= latin:
        return "ja" if kana and kana * 10 >= han + kana else "zh"
    if cyrillic > latin:
        return "ru"
    lowered = text.lower()
    words = _WORD.findall(lowered)
    scores = {lang: sum(word in stop for word in words) for lang, stop in STOPWORDS.items()}
    for lang, marks in MARKS.items():
        scores[lang] += 2 * sum(lowered.count(mark) for mark in marks)
    best = max(scores.values())
    if best == 0:
        return DEFAULT_LANGUAGE
    return next(lang for lang in ("en", "es", "de", "fr") if scores[lang] == best)


# ---------------------------------------------------------------------------------------------
# Estimates (no tokenizer at hand)

_CJK_ANY = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


def estimate_tokens(text: str) -> int:
    """Tokens in ``text`` by characters per script (CJK ~1.5, Cyrillic ~3, the rest ~4)."""
    if not text:
        return 0
    cjk = _CJK_ANY.subn("", text)[1]
    cyrillic = _CYRILLIC.subn("", text)[1]
    other = len(text) - cjk - cyrillic
    return math.ceil(cjk / CHARS_PER_TOKEN_CJK + cyrillic / CHARS_PER_TOKEN_CYRILLIC + other / CHARS_PER_TOKEN_OTHER)


def estimate_prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Tokens of a chat prompt: its texts' estimates plus a chat template's per-message overhead."""
    return REPLY_OVERHEAD + sum(MESSAGE_OVERHEAD + estimate_tokens(content_text(m.get("content")))
                                for m in messages if isinstance(m, Mapping))


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return ""


# ---------------------------------------------------------------------------------------------
# The document: templates and word lists, expanded by a fixed-seed generator

_MASK = (1 << 64) - 1
_PLACEHOLDER = re.compile(r"\{(\w+)(?:#(\d))?\}")
_GENDERS = {"m": 0, "f": 1, "n": 2, "p": 3}  # index of a value's form that agrees with it
_FRENCH_ELISION = re.compile(r"\b([Qq]u)e (?=[aeiouyàâéèêëîïôûù])")
NUM_RANGE = (2, 400)
YEAR_RANGE = (1710, 1950)


class _SplitMix64:
    """A tiny generator whose sequence is fixed by its seed forever (``random``'s methods may
    change between Python versions; this cannot)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def below(self, bound: int) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) % bound




def _compile(text: str) -> list[Any]:
    """``"In {year}, {subject} {verb#1}"`` -> ``["In ", ("year", None), ", ", ...]``."""
    parts: list[Any] = []
    position = 0
    for match in _PLACEHOLDER.finditer(text):
        if match.start() > position:
            parts.append(text[position : match.start()])
        parts.append((match.group(1), int(match.group(2)) if match.group(2) else None))
        position = match.end()
    if position < len(text):
        parts.append(text[position:])
    return parts


@dataclass(frozen=True)
class _Value:
    gender: int | None
    forms: tuple[list[Any], ...]  # "починил|починила": the forms a template or agreement picks from


@dataclass(frozen=True)
class _Spec:
    code: str
    intro: str
    joiner: str
    elide_que: bool
    templates: tuple[list[Any], ...]
    slots: dict[str, tuple[_Value, ...]]


def _value(raw: str) -> _Value:
    gender = None
    if len(raw) > 2 and raw[1] == ":" and raw[0] in _GENDERS:
        gender, raw = _GENDERS[raw[0]], raw[2:]
    return _Value(gender, tuple(_compile(form) for form in raw.split("|")))


@cache
def _spec(code: str) -> _Spec:
    from importlib import resources

    raw = json.loads(resources.files("ddtree_diag").joinpath("data", "filler", f"{code}.json").read_text("utf-8"))
    return _Spec(
        code=code,
        intro=raw["intro"],
        joiner=raw["joiner"],
        elide_que=bool(raw.get("elide_que")),
        templates=tuple(_compile(t) for t in raw["templates"]),
        slots={name: tuple(_value(v) for v in values) for name, values in raw["slots"].items()},
    )


def intro_line(language: str) -> str:
    """"Read the following document, then answer the question after it." in ``language``."""
    return _spec(_checked(language)).intro


def _checked(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"no filler text for language {language!r} (have: {', '.join(LANGUAGES)})")
    return language


class _Sentence:
    """What one sentence remembers: the gender verbs agree with, and the values already used (a
    sentence never names the same ferryman twice)."""

    def __init__(self) -> None:
        self.gender: int | None = None
        self.used: dict[str, set[int]] = {}


def _expand(parts: list[Any], spec: _Spec, rng: _SplitMix64, sentence: _Sentence, out: list[str]) -> None:
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        name, form = part
        if name == "num":
            out.append(str(NUM_RANGE[0] + rng.below(NUM_RANGE[1] - NUM_RANGE[0])))
            continue
        if name == "year":
            out.append(str(YEAR_RANGE[0] + rng.below(YEAR_RANGE[1] - YEAR_RANGE[0])))
            continue
        values = spec.slots[name]
        used = sentence.used.setdefault(name, set())
        pick = rng.below(len(values))
        for _ in range(3):
            if pick not in used or len(used) >= len(values):
                break
            pick = rng.below(len(values))
        used.add(pick)
        value = values[pick]
        if value.gender is not None:
            sentence.gender = value.gender
        index = form if form is not None else (sentence.gender or 0) if len(value.forms) > 1 else 0
        _expand(value.forms[index if index < len(value.forms) else 0], spec, rng, sentence, out)


def _sentence(spec: _Spec, rng: _SplitMix64) -> str:
    out: list[str] = []
    _expand(spec.templates[rng.below(len(spec.templates))], spec, rng, _Sentence(), out)
    text = "".join(out)
    if spec.elide_que:
        text = _FRENCH_ELISION.sub(r"\1'", text)
    return text[:1].upper() + text[1:]


class _Stream:
    """One language's endless document, generated on demand and kept: every document handed out
    is a prefix of it."""

    CHUNK = 16_384  # characters generated past what was asked, so growing is rare

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec
        self.rng = _SplitMix64(zlib.crc32(f"ddtree-diag filler {spec.code}".encode()))
        self.paragraphs: list[str] = []
        self.length = 0
        self.text = ""
        self.lock = threading.Lock()

    def at_least(self, chars: int) -> str:
        with self.lock:
            if self.length < chars:
                goal = chars + self.CHUNK
                while self.length < goal:
                    count = 3 + self.rng.below(5)  # 3 to 7 sentences a paragraph
                    paragraph = self.spec.joiner.join(_sentence(self.spec, self.rng) for _ in range(count))
                    self.length += len(paragraph) + (2 if self.paragraphs else 0)
                    self.paragraphs.append(paragraph)
                self.text = "\n\n".join(self.paragraphs)
            return self.text


@cache
def _stream(code: str) -> _Stream:
    return _Stream(_spec(code))


def filler_document(language: str, chars: int) -> str:
    """The first ``chars`` characters (at most) of the language's document, cut at a word where
    words are spaced, without trailing whitespace. Shorter documents are prefixes of longer ones."""
    spec = _spec(_checked(language))
    if chars <= 0:
        return ""
    text = _stream(language).at_least(chars + 1)
    cut = chars
    if spec.joiner == " " and not text[cut].isspace():
        space = max(text.rfind(" ", 0, cut), text.rfind("\n", 0, cut))
        cut = space if space > 0 else cut
    return text[:cut].rstrip()


# ---------------------------------------------------------------------------------------------
# Filling a prompt


def _with_document(content: Any, intro: str, document: str) -> Any:
    """The user message's new content: intro, document, then the original question last."""
    if isinstance(content, list):
        return [{"type": "text", "text": f"{intro}\n\n{document}"}, *copy.deepcopy(content)]
    return f"{intro}\n\n{document}\n\n{content if isinstance(content, str) else ''}"


def _count(counter: TokenCounter, messages: Messages) -> int | None:
    value = counter(messages)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _fit(build: Callable[[str], Messages], language: str, target: int,
         counter: TokenCounter) -> tuple[str, int] | None:
    """The longest document whose prompt ``counter`` puts within the tolerance under ``target``
    (or the closest it found); None when the counter stops answering. ``("", n)`` when even
    an empty document is at or over the target."""
    base = _count(counter, build(""))
    if base is None:
        return None
    if base >= target:
        return "", base
    slack = max(MIN_SLACK, math.ceil(target * TOLERANCE))
    aim = target - slack / 2
    sample = filler_document(language, 4096)
    chars = max(1, round((aim - base) * len(sample) / max(1, estimate_tokens(sample))))
    best: tuple[str, int] | None = None
    last: tuple[str, int] | None = None
    for _ in range(MAX_ROUNDS):
        document = filler_document(language, chars)
        if last is not None and document == last[0]:
            break  # the cut cannot move in steps this small: take the best so far
        tokens = _count(counter, build(document))
        if tokens is None:
            return None
        last = (document, tokens)
        if tokens <= target and (best is None or tokens > best[1]):
            best = last
        if target - slack <= tokens <= target:
            break
        # Tokens grow linearly with the document: rescale by what this one measured.
        per_char = max(1, tokens - base) / max(1, len(document))
        new_chars = max(1, round((aim - base) / per_char))
        if tokens > target and new_chars >= len(document):
            new_chars = len(document) - 1  # back one word
        chars = new_chars
    if best is None:  # every attempt was over the target (a counter far from linear)
        return last
    return best


def fill_messages(
    messages: Sequence[Mapping[str, Any]],
    target_tokens: int,
    *,
    count_tokens: TokenCounter | None = None,
    language: str | None = None,
) -> FilledPrompt:
    """``messages`` with their last user message grown to about ``target_tokens`` prompt tokens:
    an intro line, a document, then the original question last, all in the question's language
    (or ``language``). ``count_tokens(messages) -> int | None`` counts a whole prompt with the
    server's tokenizer; without it, or when it answers None, the size is estimated."""
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens < 1:
        raise ValueError(f"target_tokens must be a positive integer, not {target_tokens!r}")
    original: Messages = [copy.deepcopy(dict(m)) for m in messages]
    users = [i for i, m in enumerate(original) if m.get("role") == "user"]
    if not users:
        raise ValueError("no user message to fill")
    index = users[-1]
    content = original[index].get("content")
    lang = _checked(language) if language is not None else detect_language(content_text(content))
    intro = _spec(lang).intro

    def build(document: str) -> Messages:
        filled = copy.deepcopy(original)
        filled[index]["content"] = _with_document(content, intro, document)
        return filled

    fitted, estimated = None, False
    if count_tokens is not None:
        fitted = _fit(build, lang, target_tokens, count_tokens)
    if fitted is None:
        estimated = True
        fitted = _fit(build, lang, target_tokens, estimate_prompt_tokens)
        assert fitted is not None  # the estimate always answers
    document, tokens = fitted
    if not document:  # already at or over the target: the prompt stays as it was
        counted = _count(count_tokens, original) if count_tokens is not None and not estimated else None
        return FilledPrompt(messages=original, tokens=counted or estimate_prompt_tokens(original),
                            estimated=counted is None, language=lang, target_tokens=target_tokens)
    return FilledPrompt(messages=build(document), tokens=tokens, estimated=estimated, language=lang,
                        document_chars=len(document), target_tokens=target_tokens)
