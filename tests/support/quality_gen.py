"""Seeded generators of clean and garbage answers, by class, over real word lists in several
languages and scripts (tests/data/quality/words.json, from wordfreq: frequent words AND rarer ones
past the lexicon's top ranks, as real text has them, drawn by frequency).

Every generator is ``gen(rng) -> Sample``: random words, lengths, scripts and positions, so a
test or the benchmark sees new texts at every seed rather than copied strings. Used by
tests/test_quality_classes.py (a few seeds per class) and bench/bench_quality.py (recall and
false positives per class over many seeds).
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

WORDS_PATH = Path(__file__).resolve().parents[1] / "data" / "quality" / "words.json"

# Sentence ends and commas per language family (script).
_END = {"hi": "।", "ar": ".", "he": "."}
_COMMA = {"ar": "،"}
# What a prompt in each language looks like around a topic word (for prompts in the answer's language).
_ASK = {
    "en": "Tell me about {}.", "es": "Háblame de {}.", "fr": "Parle-moi de {}.", "de": "Erzähl mir von {}.",
    "it": "Parlami di {}.", "pt": "Fale-me sobre {}.", "nl": "Vertel me over {}.", "pl": "Opowiedz mi o {}.",
    "ru": "Расскажи мне о {}.", "uk": "Розкажи мені про {}.", "el": "Πες μου για {}.", "tr": "Bana {} anlat.",
    "fi": "Kerro minulle {}.", "ar": "أخبرني عن {}.", "he": "ספר לי על {}.", "hi": "मुझे {} के बारे में बताओ।",
    "id": "Ceritakan tentang {}.", "sv": "Berätta om {}.", "cs": "Řekni mi o {}.",
}
# Words no finished sentence ends on (articles, conjunctions, prepositions that take an object,
# relative words): the "stop on a function word" class. Written from grammar books, per language.
DANGLING = {
    "en": ["the", "a", "an", "and", "or", "of", "by which", "in which", "whose", "because", "with the", "to the"],
    "es": ["el", "la", "los", "y", "de", "del", "que", "con", "para el", "en la", "porque"],
    "fr": ["le", "la", "les", "et", "de", "des", "du", "que", "avec", "pour le", "dans la", "parce que"],
    "de": ["der", "die", "das", "und", "oder", "mit dem", "von der", "weil", "dass", "für die", "ein"],
    "it": ["il", "la", "lo", "e", "di", "del", "che", "con il", "per la", "perché"],
    "pt": ["o", "os", "as", "e", "de", "do", "da", "que", "com o", "para a", "porque"],
    "nl": ["de", "het", "een", "en", "of", "van de", "met het", "omdat", "dat"],
    "pl": ["i", "oraz", "w", "na", "z", "do", "dla", "że", "który", "ponieważ"],
    "ru": ["и", "в", "на", "с", "по", "для", "что", "который", "потому что", "или"],
    "uk": ["і", "та", "в", "на", "з", "для", "що", "який", "тому що"],
    "el": ["και", "το", "η", "ο", "του", "της", "με το", "για την", "που"],
    "tr": ["ve", "ile", "için bir", "ama", "çünkü", "veya"],
    "fi": ["ja", "tai", "että", "koska", "mutta"],
    "ar": ["في", "من", "على", "إلى", "و", "أن", "عن", "التي", "الذي"],
    "he": ["של", "את", "על", "עם", "ו", "כי", "אשר"],
    "hi": ["का", "की", "के", "में", "से", "को", "और", "कि", "या"],
    "id": ["yang", "dan", "di", "dari", "untuk", "dengan", "karena"],
    "sv": ["och", "att", "en", "ett", "av den", "eftersom"],
    "cs": ["a", "v", "na", "s", "z", "do", "pro", "že", "který", "protože"],
    "zh": ["和", "把", "被", "对于", "因为", "或者", "与"],
    "ja": ["を", "へ", "という", "および"],
}
# Punctuation of several scripts (what a hollow line or a run is made of).
PUNCT = [*list(".,;:!?-–—…·•*_~'\"()[]«»„“”‘’。、，！？：；・।،؛¿¡"), "...", "…", "‧"]
BULLETS = ["-", "*", "•", "·", "+", "‣", "◦", "–", ">"]
CJK_TEXT = (
    "我们今天讨论的是自然语言处理中的一些基本问题包括分词词性标注句法分析和语义理解这些任务在实际应用中都非常重要"
    "東京は日本の首都であり多くの人々が住んでいます経済と文化の中心として世界中から観光客が訪れます"
)


@dataclass
class Sample:
    text: str
    prompt: str
    finish_reason: str = "stop"
    label: str = "garbage"
    klass: str = ""
    note: str = ""
    kwargs: dict = field(default_factory=dict)

    def assess_kwargs(self) -> dict:
        return {"prompt": self.prompt, "finish_reason": self.finish_reason, **self.kwargs}


@cache
def _words() -> dict[str, tuple[list[str], list[float]]]:
    data = json.loads(WORDS_PATH.read_text(encoding="utf-8"))
    out = {}
    for lang, pairs in data.items():
        pairs = [(_final_sigma(w), f) for w, f in pairs if all(ch.isalpha() or unicodedata.category(ch)[0] == "M"
                                                                   for ch in w)]
        out[lang] = ([w for w, _ in pairs], [f for _, f in pairs])
    return out


def _final_sigma(word: str) -> str:
    return word[:-1] + "ς" if word.endswith("σ") and len(word) > 1 else word


def languages() -> list[str]:
    return sorted(_words())


def words(rng: random.Random, lang: str, n: int, *, min_len: int = 1, content: bool = False) -> list[str]:
    """n words drawn by frequency (no word twice in a row, as in real text); ``content``: from
    below the 150 most frequent (the function words), e.g. for the last word of a sentence."""
    pool, weights = _words()[lang]
    if content:
        pool, weights = pool[150:], weights[150:]
    out: list[str] = []
    while len(out) < n:
        for w in rng.choices(pool, weights=weights, k=n):
            if len(w) >= min_len and (not out or w != out[-1]):
                out.append(w)
    return out[:n]


def sentence(rng: random.Random, lang: str, lo: int = 6, hi: int = 16) -> str:
    ws = words(rng, lang, rng.randint(lo, hi) - 1) + words(rng, lang, 1, content=True)
    if len(ws) > 6 and rng.random() < 0.5:
        ws[rng.randrange(2, len(ws) - 2)] += _COMMA.get(lang, ",")
    text = " ".join(ws)
    return text[:1].upper() + text[1:] + _END.get(lang, rng.choice([".", ".", ".", "!", "?"]))


def prose(rng: random.Random, lang: str, lo: int = 2, hi: int = 5) -> str:
    return " ".join(sentence(rng, lang) for _ in range(rng.randint(lo, hi)))


def ask(rng: random.Random, lang: str) -> str:
    return _ASK[lang].format(" ".join(words(rng, lang, rng.randint(1, 3), min_len=3)))


def _lang(rng: random.Random) -> str:
    return rng.choice(languages())


def _code(rng: random.Random) -> str:
    names = [w for w in words(rng, "en", 12, min_len=3) if w.isascii()] or ["value", "item", "total"]
    fn, a, b = ([*names, "x", "y", "z"])[:3]
    body = rng.choice([
        f"def {fn}({a}, {b}):\n    \"\"\"Return the {a} plus {b}.\"\"\"\n    return {a} + {b}\n\n\nprint({fn}(2, 3))",
        f"function {fn}({a}) {{\n  const {b} = [];\n  for (let i = 0; i < {a}.length; i++) {{\n"
        f"    {b}.push({a}[i] * 2);\n  }}\n  return {b};\n}}",
        f"SELECT {a}, COUNT(*) AS n\nFROM {b}\nWHERE {fn} IS NOT NULL\nGROUP BY {a}\nORDER BY n DESC;",
    ])
    lang = {"def": "python", "fun": "javascript", "SEL": "sql"}[body[:3]]
    return f"```{lang}\n{body}\n```"


# --------------------------------------------------------------------------------------------
# Clean classes


def clean_prose(rng):
    lang = _lang(rng)
    paragraphs = [prose(rng, lang) for _ in range(rng.randint(1, 3))]
    return Sample("\n\n".join(paragraphs), ask(rng, lang), label="clean", note=lang)


def clean_list(rng):
    lang = _lang(rng)
    n = rng.randint(3, 9)
    numbered = rng.random() < 0.5
    bullet = rng.choice(BULLETS[:3])
    items = [
        (f"{i}. " if numbered else f"{bullet} ")
        + " ".join(words(rng, lang, rng.randint(0, 5)) + words(rng, lang, 1, content=True)).capitalize()
        for i in range(1, n + 1)
    ]
    head = sentence(rng, lang, 3, 8).rstrip(".!?।") + ":"
    tail = "\n\n" + sentence(rng, lang) if rng.random() < 0.5 else ""
    return Sample(head + "\n" + "\n".join(items) + tail, ask(rng, lang), label="clean", note=lang)


def clean_code(rng):
    lang = _lang(rng)
    text = sentence(rng, lang) + "\n\n" + _code(rng)
    if rng.random() < 0.6:
        text += "\n\n" + sentence(rng, lang)
    return Sample(text, "Write the code. " + ask(rng, lang), label="clean", note=lang)


def clean_table(rng):
    lang = _lang(rng)
    cols = rng.randint(2, 5)
    head = "| " + " | ".join(words(rng, lang, cols, min_len=3)) + " |"
    rows = [head, "|" + "|".join(rng.choice(["---", ":---", "---:", ":---:"]) for _ in range(cols)) + "|"]
    for _ in range(rng.randint(2, 8)):
        cells = [rng.choice([w, str(rng.randint(0, 999)), "", "✓", "—", f"{rng.random():.2f}"])
                 for w in words(rng, lang, cols)]
        rows.append("| " + " | ".join(cells) + " |")
    return Sample(sentence(rng, lang) + "\n\n" + "\n".join(rows), ask(rng, lang), label="clean", note=lang)


def clean_maths(rng):
    a, b, c = (rng.randint(2, 99) for _ in range(3))
    lines = [
        f"We solve ${a}x + {b} = {c}$ step by step.",
        f"1. Subtract {b}: ${a}x = {c - b}$.",
        f"2. Divide by {a}: $x = {c - b}/{a} \\approx {(c - b) / a:.3f}$.",
        f"$$\\int_0^{{{a}}} x^2\\,dx = \\frac{{{a}^3}}{{3}} = {a**3 / 3:.2f}$$",
        f"So x ≈ {(c - b) / a:.3f}, and Σ_{{i=1}}^{{{b}}} i = {b * (b + 1) // 2}.",
    ]
    return Sample("\n".join(lines[: rng.randint(3, 5)]), f"Solve {a}x+{b}={c}.", label="clean")


_LANGUAGE_NAMES = {"en": "English", "es": "Spanish", "fr": "French", "de": "German", "ru": "Russian", "it": "Italian"}


def clean_poem(rng):
    lang = rng.choice(sorted(_LANGUAGE_NAMES))

    def line() -> str:
        return " ".join(words(rng, lang, rng.randint(2, 6)) + words(rng, lang, 1, content=True)).capitalize()

    refrain = line()
    verses = [
        "\n".join([line() for _ in range(rng.randint(2, 4))] + [refrain, refrain]) for _ in range(rng.randint(2, 3))
    ]
    prompt = f"Write a short song in {_LANGUAGE_NAMES[lang]} with a chorus."
    return Sample("\n\n".join(verses), prompt, label="clean", note=lang)


def clean_translation(rng):
    src, dst = rng.sample(languages(), 2)
    prompt = f"Translate into {dst}: " + sentence(rng, src)
    return Sample(sentence(rng, dst), prompt, label="clean", note=f"{src}->{dst}")


def _mojibake(word: str) -> str | None:
    """The word's UTF-8 bytes read as Windows-1252 (None where a byte has no cp1252 character)."""
    try:
        return word.encode("utf-8").decode("cp1252")
    except UnicodeDecodeError:
        return None


def clean_mojibake_explained(rng):
    lang = rng.choice(["fr", "de", "es", "pt", "pl", "cs", "tr", "sv", "it", "ru", "el"])
    accented = [w for w in words(rng, lang, 300, min_len=4) if not w.isascii() and _mojibake(w)][:3] or ["café"]
    broken = [_mojibake(w) for w in accented]
    prompt = rng.choice([
        "My app shows {b} instead of {w}. Why?",
        "Why does '{b}' appear in my CSV where it should say '{w}'?",
        "What is this: {b}",
    ]).format(b=broken[0], w=accented[0])
    text = (
        f"That is mojibake: the UTF-8 bytes of “{accented[0]}” were decoded as Latin-1, so each accented "
        f"letter became two characters and “{accented[0]}” turned into “{broken[0]}”. "
        + (f"Likewise “{broken[1]}” should read “{accented[1]}”. " if len(broken) > 1 else "")
        + "Read the file as UTF-8 (or repair it with ftfy.fix_encoding) and the text comes back."
    )
    return Sample(text, prompt, label="clean", note=lang)


def clean_short(rng):
    lang = _lang(rng)
    word = words(rng, lang, 1, min_len=3, content=True)[0]
    text = rng.choice([word.capitalize(), word.capitalize() + ".", str(rng.randint(0, 10_000)), "Yes.", "No."])
    return Sample(text, ask(rng, lang), label="clean", note=lang)


def clean_quoted_punctuation(rng):
    """Answers about punctuation and formatting that show runs, rules and bullets on purpose."""
    ch = rng.choice(["-", "=", "*", "_", "#", "~"])
    lang = "en"
    text = rng.choice([
        f"In Markdown, a line of three or more `{ch}` characters makes a rule:\n\n```\n{ch * rng.randint(3, 12)}\n```",
        "Chapter 1 " + "." * rng.randint(8, 30) + " 3\nChapter 2 " + "." * rng.randint(8, 30) + " 17",
        "Fill in the blanks:\nName: " + "_" * rng.randint(8, 20) + "\nDate: " + "_" * rng.randint(8, 20),
        f"{sentence(rng, lang)}\n\n---\n\n{sentence(rng, lang)}\n\n---\n\n{sentence(rng, lang)}",
        "Wait... what?! That's amazing!!! " + sentence(rng, lang),
    ])
    return Sample(text, "Show me how to format text.", label="clean")


# --------------------------------------------------------------------------------------------
# Garbage classes


def _opening(rng: random.Random, lang: str) -> str:
    return sentence(rng, lang) + " " if rng.random() < 0.7 else ""


def glued_repeat(rng):
    lang = _lang(rng)
    unit = rng.choice(words(rng, lang, 30, min_len=3))
    if rng.random() < 0.3:
        unit = unit.capitalize()
    run = unit * rng.randint(3, 14)
    where = rng.random()
    text = _opening(rng, lang) + run if where < 0.6 else _opening(rng, lang) + run + " " + sentence(rng, lang)
    finish = rng.choice(["stop", "length"])
    return Sample(text, ask(rng, lang), finish, note=f"{lang} {unit!r}")


def _hollow_line(rng: random.Random, fixed: str | None) -> str:
    if fixed is not None:
        return fixed
    return rng.choice([rng.choice(BULLETS), rng.choice(PUNCT), rng.choice(BULLETS) + " ", rng.choice(PUNCT) * 2])


def hollow_lines(rng):
    lang = _lang(rng)
    fixed = rng.choice([None, rng.choice(PUNCT), rng.choice(BULLETS)])
    lines = [_hollow_line(rng, fixed) for _ in range(rng.randint(3, 15))]
    head = sentence(rng, lang, 2, 8).rstrip(".!?।") + ":" if rng.random() < 0.7 else ""
    blank = "\n\n" if rng.random() < 0.3 else "\n"
    return Sample((head + "\n" if head else "") + blank.join(lines), ask(rng, lang), rng.choice(["stop", "length"]),
                  note=f"{lang} {lines[0]!r}")


def empty_bullets(rng):
    lang = _lang(rng)
    n = rng.randint(3, 10)
    bullet = rng.choice([*BULLETS[:4], "1.", "a)"])
    items = []
    filled = rng.randint(0, 1)
    for i in range(n):
        marker = f"{i + 1}." if bullet == "1." else (f"{chr(97 + i)})" if bullet == "a)" else bullet)
        content = " " + " ".join(words(rng, lang, 3)) if i < filled else rng.choice(["", " ", "  "])
        items.append(marker + content)
    head = sentence(rng, lang, 2, 8).rstrip(".!?।") + ":"
    return Sample(head + "\n" + "\n".join(items), ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def punct_run(rng):
    lang = _lang(rng)
    ch = rng.choice([c for c in PUNCT if len(c) == 1])
    spaced = rng.random() < 0.25
    n = rng.randint(10, 80)
    run = (" ".join([ch] * n)) if spaced else ch * n
    text = _opening(rng, lang) + sentence(rng, lang) + " " + run
    if rng.random() < 0.4:
        text += " " + sentence(rng, lang)
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=f"{lang} {ch!r}×{n}")


def counting(rng):
    lang = _lang(rng)
    start = rng.randint(1, 3)
    n = rng.randint(4, 20)
    style = rng.choice(["{}.", "{})", "({})", "{}:", "Step {}:", "{}、", "#{}"])
    sep = rng.choice([" ", "\n", "\n\n", "  "])
    seq = sep.join(style.format(i) for i in range(start, start + n))
    head = _opening(rng, lang) + (sentence(rng, lang, 2, 6).rstrip(".!?।") + ":" if rng.random() < 0.6 else "")
    return Sample((head + sep + seq).strip(), ask(rng, lang), rng.choice(["stop", "length"]), note=f"{lang} {style}")


def header_symbol(rng):
    lang = _lang(rng)
    header = " ".join(words(rng, lang, rng.randint(1, 3), min_len=2)).capitalize() + rng.choice(["", ":", "**"])
    symbol = rng.choice(PUNCT + BULLETS)
    k = rng.randint(3, 12)
    if rng.random() < 0.5:  # header, then the symbol line over and over
        text = header + "\n" + "\n".join([symbol] * k)
    else:  # header and symbol alternating
        text = "\n".join(f"{header}\n{symbol}" for _ in range(k))
    return Sample(_opening(rng, lang) + "\n" + text, ask(rng, lang), rng.choice(["stop", "length"]),
                  note=f"{lang} {header!r}/{symbol!r}")


def doubled_words(rng):
    lang = _lang(rng)
    ws = words(rng, lang, rng.randint(6, 20))
    doubled = " ".join(f"{w} {w}" for w in ws)
    text = _opening(rng, lang) + doubled[:1].upper() + doubled[1:] + _END.get(lang, ".")
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def salad_text(rng: random.Random, lang: str, n_words: int) -> str:
    """Real words cut at wrong places and glued: the text a draft/target position bug produces."""
    ws = words(rng, lang, n_words)
    joined = "".join(ws)
    pieces, at = [], 0
    while at < len(joined):
        step = rng.randint(2, 7)
        pieces.append(joined[at : at + step])
        at += step
    return " ".join(pieces)


def salad_prose(rng):
    lang = _lang(rng)
    text = salad_text(rng, lang, rng.randint(8, 30))
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def salad_after_opening(rng):
    lang = _lang(rng)
    text = prose(rng, lang, 1, 2) + " " + salad_text(rng, lang, rng.randint(10, 30))
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def salad_after_code(rng):
    lang = _lang(rng)
    text = sentence(rng, lang) + "\n\n" + _code(rng) + "\n\n" + salad_text(rng, lang, rng.randint(10, 30))
    return Sample(text, "Write the code. " + ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def glued_function_words(rng):
    """Words glued in pairs and stray suffixes split off (``ofthe``, ``convert ed``)."""
    lang = _lang(rng)
    ws = words(rng, lang, rng.randint(12, 30))
    out, i = [], 0
    while i < len(ws):
        r = rng.random()
        if r < 0.4 and i + 1 < len(ws):
            out.append(ws[i] + ws[i + 1])
            i += 2
        elif r < 0.7 and len(ws[i]) >= 5:
            cut = rng.randint(2, len(ws[i]) - 2)
            out += [ws[i][:cut], ws[i][cut:]]
            i += 1
        else:
            out.append(ws[i])
            i += 1
    text = _opening(rng, lang) + " ".join(out) + _END.get(lang, ".")
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=lang)


def function_word_stop(rng):
    lang = rng.choice(sorted(DANGLING))
    last = rng.choice(DANGLING[lang])
    if lang in ("zh", "ja"):
        text = CJK_TEXT[rng.randrange(0, 40) :][: rng.randint(8, 40)] + last
        return Sample(text, "请介绍一下。" if lang == "zh" else "説明してください。", "stop", note=f"{lang} {last!r}")
    body = prose(rng, lang, 0, 2) + " " + " ".join(words(rng, lang, rng.randint(4, 12)))
    text = body.strip()[:1].upper() + body.strip()[1:] + " " + last
    return Sample(text, ask(rng, lang), "stop", note=f"{lang} {last!r}")


def mid_word_stop(rng):
    """Prose that stops inside a long word ("... because of Rayleigh scatt"), finish_reason stop."""
    lang = rng.choice([lang for lang in languages() if lang not in ("zh", "ja")])
    known = set(_words()[lang][0])
    long_word = words(rng, lang, 1, min_len=8, content=True)[0]
    cuts = [long_word[:k] for k in range(5, len(long_word) - 2) if long_word[:k] not in known]
    cut = rng.choice(cuts) if cuts else long_word[:5]
    body = prose(rng, lang, 1, 2) + " " + " ".join(words(rng, lang, rng.randint(4, 10)))
    return Sample(body + " " + cut, ask(rng, lang), "stop", note=f"{lang} {long_word!r} -> {cut!r}")


def restart(rng):
    """A sentence that breaks off inside a word and starts again, then runs on ("... into IP addr
    DNS, the Domain ... into IP addresses so ..."): a decoder resuming from an old state."""
    lang = rng.choice([lang for lang in languages() if lang not in ("zh", "ja")])
    head = words(rng, lang, rng.randint(3, 8))
    long_word = words(rng, lang, 1, min_len=7, content=True)[0]
    sentence_text = " ".join([*head, long_word, *words(rng, lang, rng.randint(2, 6))])
    sentence_text = sentence_text[:1].upper() + sentence_text[1:] + _END.get(lang, ".")
    cut_at = len(" ".join(head)) + 1 + rng.randint(2, len(long_word) - 2)
    before = prose(rng, lang, 0, 2)
    text = (before + " " if before else "") + sentence_text[:cut_at] + rng.choice([" ", "\n", "  "]) + sentence_text
    return Sample(text, ask(rng, lang), rng.choice(["stop", "length"]), note=f"{lang} {long_word!r}")


Generator = Callable[[random.Random], Sample]

CLEAN: dict[str, Generator] = {
    "prose": clean_prose, "list": clean_list, "code": clean_code, "table": clean_table, "maths": clean_maths,
    "poem": clean_poem, "translation": clean_translation, "mojibake explained": clean_mojibake_explained,
    "short": clean_short, "formatting": clean_quoted_punctuation,
}
GARBAGE: dict[str, Generator] = {
    "glued repeat": glued_repeat, "hollow lines": hollow_lines, "empty bullets": empty_bullets,
    "punctuation run": punct_run, "counting": counting, "header+symbol": header_symbol,
    "doubled words": doubled_words, "salad": salad_prose, "salad after opening": salad_after_opening,
    "salad after code": salad_after_code, "glued/split words": glued_function_words,
    "function-word stop": function_word_stop, "mid-word stop": mid_word_stop, "restart": restart,
}


def generate(klass: str, seed: int) -> Sample:
    gen = CLEAN.get(klass) or GARBAGE[klass]
    sample = gen(random.Random(f"{klass}:{seed}"))
    sample.klass = klass
    sample.text = unicodedata.normalize("NFC", sample.text)
    return sample
