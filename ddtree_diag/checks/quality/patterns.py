"""Patterns and word lists the signals share, compiled once at import."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

EVIDENCE_CHARS = 80


# --------------------------------------------------------------------------------------------
# Patterns. Compiled once at import (stdlib `re`); the `regex` module, for Unicode script
# properties, is loaded on the first non-ASCII text.

# Words (letters/marks/digits, with inner apostrophes), one CJK/kana character each, newline runs,
# and punctuation runs. Spaces are dropped: a loop is about what repeats, not how it is spaced.
# (stdlib `re` here: about twice as fast as `regex` on this simple pattern; CJK ranges by hand.)
_CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# An IPv6 or MAC address ("ffff:ffff:ffff:ffff::", "00:1a:2b:3c:4d:5e"; 4-8 groups) is one token: its groups
# repeat by design, not as a loop.
TOKEN_RE = re.compile(
    rf"[0-9a-f]{{1,4}}(?::[0-9a-f]{{0,4}}){{3,7}}(?![\w:])|[{_CJK_RANGES}]|[^\W{_CJK_RANGES}]+(?:['’][^\W{_CJK_RANGES}]+)*"
    r"|\n+|[^\w\s]+"
)
WORDISH_RE = re.compile(r"[^\W\d_]")
HAS_CONTENT_RE = re.compile(r"[^\W_]|[^\x00-\x7f]")
ONLY_MARKER_RE = re.compile(r"(?:\d{1,3}[.)]|[-*•]|step \d+:?)", re.IGNORECASE)
MOJIBAKE_PROMPT_RE = re.compile(r"mojibake|encod|utf|latin-?1|cp1252|乱码|文字化け", re.IGNORECASE)
NONSPACE_RE = re.compile(r"\S+")
FIRST_WORD_RE = re.compile(r"[^\w]*(\w+)")
WORDS_RE = re.compile(r"[^\W_]+")
# A letter, or a combining mark of Indic, Arabic or Hebrew writing (`re` has no \p{M}, and \w
# leaves the vowel signs out, cutting "है" in two).
LETTER = (r"(?:[^\W\d_]|[\u0300-\u036f\u0591-\u05c7\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06ed"
          r"\u0900-\u0963\u0966-\u0dff])")  # (the Devanagari dandas, sentence ends, are left out)
MARKED_WORDS_RE = re.compile(rf"(?:{LETTER}|\d)+")
CJK_CHAR_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
SENTENCE_END_RE = re.compile(r"[.!?。！？]\s")

_SCRIPT_GROUPS = (
    ("Latin", r"\p{Latin}"),
    ("Han", r"\p{Han}"),
    ("Kana", r"[\p{Hiragana}\p{Katakana}ー]"),
    ("Hangul", r"\p{Hangul}"),
    ("Cyrillic", r"\p{Cyrillic}"),
    ("Greek", r"\p{Greek}"),
    ("Arabic", r"\p{Arabic}"),
    ("Hebrew", r"\p{Hebrew}"),
    ("Devanagari", r"\p{Devanagari}"),
    ("Thai", r"\p{Thai}"),
    ("Armenian", r"\p{Armenian}"),
    ("Georgian", r"\p{Georgian}"),
    ("Bengali", r"\p{Bengali}"),
    ("Tamil", r"\p{Tamil}"),
    ("Ethiopic", r"\p{Ethiopic}"),
)


# Where the `regex` module is missing (the single-file build vendors nothing compiled), the same
# classes from Unicode block ranges: blocks are a close approximation of scripts for letters.
_SCRIPT_RANGES = {
    "Latin": "A-Za-z\u00aa\u00ba\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u1e00-\u1eff\u2c60-\u2c7f"
    "\ua720-\ua7ff\uab30-\uab6f\uff21-\uff3a\uff41-\uff5a",
    "Han": "\u2e80-\u2fdf\u3005\u3007\u3021-\u3029\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
    "\U00020000-\U0003134f",
    "Kana": "\u3041-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9d",
    "Hangul": "\u1100-\u11ff\u3131-\u318e\ua960-\ua97f\uac00-\ud7af\ud7b0-\ud7ff\uffa0-\uffdc",
    "Cyrillic": "\u0400-\u0482\u048a-\u052f\u1c80-\u1c8f\u2de0-\u2dff\ua640-\ua69f",
    "Greek": "\u0370-\u0373\u0376-\u037d\u037f-\u03ff\u1f00-\u1fff",
    "Arabic": "\u0620-\u064a\u066e-\u06d3\u06d5\u06fa-\u06ff\u0750-\u077f\u08a0-\u08ff"
    "\ufb50-\ufdff\ufe70-\ufefc",
    "Hebrew": "\u05d0-\u05f2\ufb1d-\ufb4f",
    "Devanagari": "\u0900-\u0963\u0966-\u097f\ua8e0-\ua8ff",
    "Thai": "\u0e01-\u0e3a\u0e40-\u0e5b",
    "Armenian": "\u0531-\u0556\u0559-\u058a\ufb13-\ufb17",
    "Georgian": "\u10a0-\u10ff\u1c90-\u1cbf\u2d00-\u2d2f",
    "Bengali": "\u0980-\u09ff",
    "Tamil": "\u0b80-\u0bff",
    "Ethiopic": "\u1200-\u139f\u2d80-\u2ddf",
}
_COMBINING_MARKS = (
    "\u0300-\u036f\u0483-\u0489\u0591-\u05bd\u064b-\u065f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
)


@cache
def script_run_re() -> Any:
    """Runs of letters of one script (anything else lettered is "Other"). The `regex` module
    knows Unicode script properties; it is imported on the first non-ASCII text only."""
    try:
        import regex
    except ImportError:
        return re.compile(
            "|".join(f"(?P<{name}>(?:[{_SCRIPT_RANGES[name]}][{_COMBINING_MARKS}]*)+)" for name, _ in _SCRIPT_GROUPS)
            + r"|(?P<Other>[^\W\d_]+)"
        )
    return regex.compile(
        "|".join(f"(?P<{name}>(?:{cls}[\\p{{M}}]*)+)" for name, cls in _SCRIPT_GROUPS)
        + r"|(?P<Other>(?:(?![\p{Common}\p{Inherited}])\p{L})+)"
    )


# Stretches that may hold non-Latin letters: everything outside ASCII, Latin blocks, combining
# marks, general punctuation/symbols/maths and emoji. Only these go through the (slower) script
# classifier (script_run_re).
NON_LATIN_CANDIDATE_RE = re.compile(
    "[^\x00-\u036f\u1e00-\u1eff\u2000-\u2bff\ufe00-\ufe0f\U0001f000-\U0001faff\\s]+"
)
NOT_ASCII_LETTERS = bytes(b for b in range(128) if not chr(b).isalpha())
ASCII_PAIR_RE = re.compile(r"[A-Za-z]{2}")

# Prompt words that allow (or ask for) other writing systems in the answer.
ANY_SCRIPT_RE = re.compile(
    r"translat|traduc|traduz|übersetz|uebersetz|перев[оеё]д|翻译|翻譯|翻訳|번역|"
    r"multilingual|\b(?:in|into|across)\b[^.?!\n]{0,30}\blanguages\b|idiomas|langues|"
    r"sprachen|языках|多语|多種言語|unicode|writing system|character set|charset|encoding|alphabet|"
    r"(?:native|local|original) (?:script|language|writing|spelling|name)",
    re.IGNORECASE,
)
_LANGUAGE_SCRIPTS = (
    (
        r"chin(?:a|ese)|taiwan|hong kong|mandarin|cantonese|hanzi|kanji|pinyin|"
        r"中文|汉语|漢語|华语|普通话|汉字|漢字|chino|chinois|chinesisch|chinês|cines[ei]|китайск|중국",
        {"Han"},
    ),
    (
        r"japan|japon|giappon|hiragana|katakana|kana\b|日本語|日语|日文|японск|일본",
        {"Han", "Kana"},
    ),
    (r"korea|corea|coré|hangul|한국어|韩语|韓国語|корейск", {"Hangul", "Han"}),
    (
        r"russia|cyrillic|ukrain|bulgarian|serbian|belarusian|kazakh|mongolian|"
        r"русск|украин|rus[os]|russ[eo]|russisch|俄语|ロシア語|러시아",
        {"Cyrillic"},
    ),
    (r"greek|greece|ελληνικ|grieg|grec|greg|griech|希腊", {"Greek"}),
    (r"\barab|egypt|persian|\biran|farsi|urdu|pakistan|عرب|árabe|arabe|arabisch|阿拉伯", {"Arabic"}),
    (r"hebrew|israel|yiddish|עברית|hebr|ebraic", {"Hebrew"}),
    (r"india|hindi|sanskrit|marathi|nepali|devanagari|हिन्दी|हिंदी", {"Devanagari"}),
    (r"\bthai|ภาษาไทย|泰语", {"Thai"}),
    (r"armenian", {"Armenian"}),
    (r"georgian", {"Georgian"}),
    (r"bengali|bangla", {"Bengali"}),
    (r"tamil", {"Tamil"}),
    (r"amharic|ethiopic|tigrinya", {"Ethiopic"}),
)
LANGUAGE_SCRIPTS_RE = [(re.compile(p, re.IGNORECASE), s) for p, s in _LANGUAGE_SCRIPTS]

# Chat-template special tokens of the common families (ChatML, Llama 2/3, Mistral, Gemma, Phi, GPT-OSS,
# DeepSeek's full-width bars, SentencePiece markers).
TEMPLATE_RE = re.compile(
    r"<\|[A-Za-z_][\w.\-]{0,40}\|>"
    r"|<｜[^｜<>\n]{1,40}｜>"
    r"|</s>|<s>(?=\s*\[INST\])|\[/?INST\]|<</?SYS>>"
    r"|\[/?(?:TOOL_CALLS|AVAILABLE_TOOLS|TOOL_RESULTS|SYSTEM_PROMPT)\]"  # Mistral's control tokens
    r"|<(?:start|end)_of_turn>|<(?:bos|eos|unk|pad|eot)>"
    r"|<\|(?:im_start|im_end|im_sep)\b"
)
# Conversation turn markers at a line start. Group "bare": the marker alone on its line (what a
# ChatML leak looks like once the special tokens are stripped); "head": a markdown heading;
# "instr": Alpaca-style headers; "content": a dialogue line with text after the colon.
ROLE_RE = re.compile(
    r"(?m)^[ \t>*_]*(?:"
    r"(?P<head>\#{1,6}[ \t]*(?:user|assistant|human|system)[ \t\r]*(?::[^\n]*|(?=\n|$)))"
    r"|(?P<instr>\#{2,3}[ \t]*(?:instruction|response|human|assistant|user)[ \t]*:)"
    r"|(?P<bare>(?:(?:user|assistant|human)[ \t]*:?|(?-i:system|model))[ \t\r]*(?=\n|$))"
    r"|(?P<human>human[ \t]*:[ \t]*\S)"
    r"|(?P<content>(?:user|assistant|ai|bot|gpt|chatbot)[*_]*[ \t]*:[*_]*[ \t]*\S)"
    r")",
    re.IGNORECASE,
)
DIALOGUE_PROMPT_RE = re.compile(
    r"dialog|conversation|\bchat\b|chat log|transcript|role[- ]?play|screenplay|skit|interview|"
    r"chat template|chatml|prompt format|few-shot|system prompt|prompt engineering|example prompt|"
    r"对话|對話|會話|会話|диалог|Gespräch|diálogo",
    re.IGNORECASE,
)

TEMPLATE_PROMPT_RE = re.compile(
    r"special tokens?|tokeni[sz]|stop tokens?|chat.?template|chatml|\beos\b|\bbos\b|"
    r"end.of.(?:text|turn|sequence)|prompt.{0,20}format|format.{0,20}prompt|im_start|im_end|\[inst\]|"
    r"jinja|\b(?:qwen|llama|mistral|gemma|phi-?\d|deepseek|vicuna|alpaca)",
    re.IGNORECASE,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# C0 (but tab/newline/CR), DEL, C1, lone surrogates, non-characters.
CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
# Characters that UTF-8-as-Latin-1/cp1252 mojibake always produces; gates the (slower) ftfy check.
MOJIBAKE_GATE_RE = re.compile(
    r"[\u00c2-\u00c5\u00ce-\u00d1\u00e2\u00e3\u00ef\u0152\u0153\u0161\u201a-\u201e"
    r"\u2020\u2021\u2030\u2039\u203a\u02c6\u02dc\u0080-\u009f]"
)

# Two list markers with nothing between ("1. 1.", "2.\n2."): a cheap gate (it starts with a
# digit, which the regex engine scans for fast) before the full marker walk.
STUCK_GATE_RE = re.compile(r"\d[.)][^\w\n]{0,4}\n?[^\w\n]{0,4}\d[.)]")
# A list marker ("1." / "1)") at a word boundary followed by space or end.
# ("#12)" is an issue reference, not a marker.)
MARKER_RE = re.compile(r"(?<![\w.,#])(\d{1,3})[.)](?=\s|$)")

INLINE_CODE_RE = re.compile(r"`[^`\n]+`")

LYRIC_PROMPT_RE = re.compile(
    r"\b(?:songs?|lyrics?|poems?|poetry|verses?|chants?|rhym\w*|haikus?|sonnets?|limericks?|refrains?|"
    r"chorus(?:es)?|nursery|ballads?|raps?|anthems?|hymns?|lullab(?:y|ies)|christmas carols?|carols|"
    r"canci[oó]n\w*|poemas?|gedichte?|chansons?)\b"
    r"|(?:^|[.!?]\s+)sing\b|\bsing\s+(?:me|us|along)\b"  # "Sing Row, Row...", not "Why do birds sing?"
    r"|歌|诗|詩|песн|стих",
    re.IGNORECASE,
)
REPEAT_PROMPT_RE = re.compile(
    r"\brepeat|\btimes\b|\btwice\b|\bthrice\b|over and over|again and again|"
    r"重复|重複|繰り返|повтор|wiederhol|repite|répète|\bspell|\bcount\b|list all",
    re.IGNORECASE,
)

# How many times a repetition prompt asks for something: "50 times", "twice", "count to 1,000",
# "20 次" (digits, or English number words). The answer may repeat that often.
_COUNT_WORDS = {
    word: value for value, words in enumerate((
        "", "once", "two twice", "three thrice", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve dozen", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    )) for word in words.split()
} | {"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90,
     "hundred": 100, "thousand": 1000}
_NUMBER = r"\d{1,3}(?:,\d{3})+(?![\d.,]\d)|\d{1,5}(?![\d.,]\d)|\b(?:" + "|".join(_COUNT_WORDS) + r")\b"
COUNT_RE = re.compile(
    rf"(?<![\d.,])(?P<times>{_NUMBER})\s*(?:times\b|repetitions\b|x\b|次|回|раз)|\b(?P<word>twice|thrice)\b"
    rf"|\bcount\b[^.\n]{{0,30}}?\bto\s+(?P<to>{_NUMBER})",
    re.IGNORECASE,
)


def count_value(match: re.Match) -> int:
    """The count a ``COUNT_RE`` match names."""
    token = match.group("times") or match.group("word") or match.group("to")
    token = token.replace(",", "")
    return int(token) if token.isdigit() else _COUNT_WORDS[token.lower()]


# Interjections and sounds that people do write several times in a row.
_INTERJECTIONS_TEXT = (
    "ha he hi ho hah heh hee la na da di do doo oh ooh ah aah uh um hmm mm no yes yeah yay "
    "hey wow bye go very so really much more tick tock knock ding dong bang boom beep buzz choo "
    "woof meow quack moo baa oink tweet chirp zzz bla blah yada rah hip hurray hooray pew "
    "哈 呵 嘿 啊 嗯 哦 呜 啦 嘻 は ふ へ ほ ひ"
)
INTERJECTIONS = frozenset(_INTERJECTIONS_TEXT.split())

# (";" is left out: code and SQL end on it.)
UNFINISHED_END = tuple(",，、:：；(（[{—–-“«‘")
# Words an English/Spanish/German/French sentence cannot end on (prepositions and pronouns can).
_FUNCTION_WORDS_TEXT = (
    "a an the and or but nor because although whereas unless my your our their whose y und oder et ou"
)
FUNCTION_WORDS = frozenset(_FUNCTION_WORDS_TEXT.split())
# Per language (wordfreq codes): words no finished sentence ends on: articles, conjunctions,
# prepositions that need their object, relative words. Left out where the word also ends
# sentences as a pronoun or a verb particle (German "das", "mit"; Dutch "het"; Swedish "det";
# French "en", "le" after a hyphen is skipped by the caller).
_DANGLING_BY_LANGUAGE = {
    "en": "a an the and or but nor because although whereas unless my your our their whose which of",
    "es": "el los un una y e o u de del que con para por sin porque aunque mi tu su sus nuestro cuyo",
    "pt": "o os um uma e de do da dos das com para em no na nos nas porque mas ou meu teu seu cujo",
    "it": "il lo gli un una uno e ed di del della dei delle che con per nel nella perché ma o mio tuo",
    "fr": "le les un une et de des du au aux que avec pour dans sur parce mais ou mon ton son ses dont",
    "ca": "el els un una i de del que amb per perquè però o",
    "de": "ein eine einen einem einer und oder aber weil dass sondern denn mein dein sein ihr unser",
    "nl": "de een en of omdat maar want mijn jouw zijn haar",
    "sv": "och att en ett eftersom men eller min din sin",
    "da": "og at en et fordi men eller min din sin",
    "nb": "og at en et fordi men eller min din sin",
    "pl": "i oraz w we na z ze do dla że który która które ponieważ ale lub albo mój twój",
    "cs": "a v ve na s se z ze do pro že který která které protože ale nebo",
    "sk": "a v vo na s so z zo do pre že ktorý ktorá ktoré pretože ale alebo",
    "ru": "и в во на с со по для к ко о об от из до за что который которая которое которые а но или потому чтобы",
    "uk": "і й та в у на з із зі по для до від що який яка яке які але або бо щоб",
    "bg": "и в във на с със по за към от до че който която което които но или защото",
    "el": "και το η ο οι τα του της των με για σε από ότι αλλά ή ένα μια",
    "tr": "ve veya ile ama fakat çünkü",
    "id": "yang dan di dari untuk dengan karena atau tetapi ke pada",
    "ms": "yang dan di dari untuk dengan kerana atau tetapi ke pada",
    "ro": "și sau cu de din pentru că care dar un o",
    "hu": "a az és vagy de hogy mert egy",
    "fi": "ja tai että koska mutta",
    "ar": "في من على إلى و أن عن التي الذي ثم أو لكن مع هي هو",
    "fa": "و در از به با که برای را یا اما",
    "he": "של את על עם אשר כי או אל מן",
    "hi": "का की के में से को और कि या पर लेकिन तथा एवं",
    "ur": "کا کی کے میں سے کو اور کہ یا پر لیکن",
}
DANGLING_BY_LANGUAGE = {lang: frozenset(words.split()) for lang, words in _DANGLING_BY_LANGUAGE.items()}
# Where an article can end a sentence as a pronoun (German "das", Swedish "det"), a preposition
# right before it still makes the ending dangling ("mit dem", "av den", "van de").
_PREPOSITION_ARTICLE = {
    "de": ("mit von zu bei nach aus für auf in an über unter vor durch gegen ohne um", "der die das dem den des"),
    "nl": ("van met in op voor aan naar bij uit over door", "de het"),
    "sv": ("av på i med för till från om under över", "den det de"),
    "da": ("af på i med for til fra om under over", "den det de"),
    "nb": ("av på i med for til fra om under over", "den det de"),
    "en": ("of in on at by for with from to into about", "this these those its"),
    # Romance and Greek: a preposition and the article it governs ("per la", "para a", "για την").
    "es": ("de con para por sin en desde hacia sobre entre contra hasta", "la las el los un una"),
    "pt": ("de com para por sem em sobre entre até contra", "a as o os um uma"),
    "it": ("per con su tra fra in di da senza verso", "la le lo gli il i un una"),
    "fr": ("dans pour avec sur sous sans par entre vers chez contre de", "la le les un une"),
    "ca": ("per amb sense de en sobre entre cap", "la les el els un una"),
    "el": ("για σε από με προς χωρίς μετά κατά", "την τον το τα τη τις τους η ο οι"),
}
PREPOSITION_ARTICLE = {
    lang: (frozenset(preps.split()), frozenset(articles.split()))
    for lang, (preps, articles) in _PREPOSITION_ARTICLE.items()
}
# Chinese and Japanese: a last character (or two) that needs what follows.
# (Left out: 在/对/及 end sentences as verbs or in set phrases; が/に/から/の end polite or casual
# Japanese sentences.)
DANGLING_CJK = ("和", "把", "被", "对于", "因为", "或者", "但是", "而且", "以及", "与", "を", "へ", "という", "および")
STOP_REASONS = frozenset({"stop", "eos", "end_turn", "stop_sequence", "eos_token"})
LENGTH_REASONS = frozenset({"length", "max_tokens", "max_length", "max_new_tokens"})
