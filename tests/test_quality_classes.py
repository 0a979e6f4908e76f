"""Garbage classes and clean shapes, generated: random words of 19 languages in 6 scripts (real
word lists, tests/support/quality_gen.py), random lengths, positions and punctuation. Each garbage class
must be caught (and by the signal made for it), each clean shape must stay clean, over seeds the
detector was never tuned on (bench/bench_quality.py measures the same classes over 200 seeds).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_diag.checks.quality import assess
from tests.support import quality_gen

SEEDS = range(1000, 1040)  # not the bench's seeds (0-199)

# class -> (least recall over SEEDS, the codes that should name it)
GARBAGE = {
    "glued repeat": (0.95, {"glued_repeat"}),
    "hollow lines": (0.85, {"empty_list", "punct_run", "empty_output"}),  # nothing else in it: empty
    "empty bullets": (0.95, {"empty_list"}),
    "punctuation run": (0.9, {"punct_run", "token_loop"}),
    "counting": (0.95, {"empty_list", "degenerate_enumeration"}),
    "header+symbol": (0.85, {"empty_list", "punct_run", "line_loop", "empty_output"}),
    "doubled words": (0.95, {"doubled_words"}),
    "salad": (0.7, {"word_salad"}),
    "salad after opening": (0.8, {"word_salad"}),
    "salad after code": (0.8, {"word_salad"}),
    "glued/split words": (0.7, {"word_salad"}),
    "function-word stop": (0.9, {"premature_stop"}),
    # a cut that is itself a word ("рассказ" of "рассказывал") cannot be told: ~80 % over the bench's seeds
    "mid-word stop": (0.7, {"premature_stop"}),
    "restart": (0.95, {"restart"}),
}


@pytest.mark.parametrize("klass", sorted(GARBAGE))
def test_each_garbage_class_is_caught_and_named(klass):
    least, codes = GARBAGE[klass]
    caught = named = 0
    for seed in SEEDS:
        sample = quality_gen.generate(klass, seed)
        verdict = assess(sample.text, **sample.assess_kwargs())
        caught += verdict.garbage
        named += verdict.garbage and bool(codes & set(verdict.codes))
    assert caught / len(SEEDS) >= least, (klass, caught)
    assert named >= 0.9 * caught, (klass, named, caught)


@pytest.mark.parametrize("klass", sorted(quality_gen.CLEAN))
def test_each_clean_shape_stays_clean(klass):
    flagged = []
    for seed in SEEDS:
        sample = quality_gen.generate(klass, seed)
        verdict = assess(sample.text, **sample.assess_kwargs())
        if verdict.garbage:
            flagged.append((sample.note, sample.text[:80], verdict.codes))
    assert not flagged, flagged


# --------------------------------------------------------------------------------------------
# Properties: any word of any list, any count and place.

LANGS = quality_gen.languages()
word_in_any_language = st.sampled_from(LANGS).flatmap(
    lambda lang: st.integers(0, 10_000).map(lambda seed: quality_gen.words(random.Random(seed), lang, 1, min_len=3)[0])
)
opening = st.sampled_from(LANGS).flatmap(
    lambda lang: st.integers(0, 10_000).map(lambda seed: quality_gen.sentence(random.Random(seed), lang))
)


@settings(max_examples=60, deadline=None)
@given(word_in_any_language, st.integers(3, 20), opening, st.booleans())
def test_a_word_glued_to_itself_is_a_glued_repeat(word, times, before, capital):
    unit = word.capitalize() if capital else word
    if len(set(unit.lower())) == 1:
        return  # "aaa": a drawn-out sound
    verdict = assess(before + " " + unit * times, prompt="Tell me more.", finish_reason="stop")
    if times >= (4 if len(unit) == 2 else 3):
        assert "glued_repeat" in verdict.codes and verdict.garbage, verdict.to_dict()


@settings(max_examples=60, deadline=None)
@given(st.lists(word_in_any_language, min_size=4, max_size=12, unique=True), opening)
def test_every_word_said_twice_is_doubled_words(words, before):
    doubled = " ".join(f"{w} {w}" for w in words)
    verdict = assess(before + " " + doubled + ".", prompt="Tell me more.", finish_reason="stop")
    assert verdict.garbage and {"doubled_words", "token_loop", "phrase_loop"} & set(verdict.codes), verdict.to_dict()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(quality_gen.PUNCT + quality_gen.BULLETS), st.integers(3, 20), opening,
       st.sampled_from(["\n", "\n\n"]))
def test_lines_of_one_mark_are_an_empty_list(mark, lines, before, gap):
    if set(mark) <= set("{}[]();/\\|`\"'"):
        return  # a line of brackets or quotes is code
    verdict = assess(before + "\n" + gap.join([mark] * lines), prompt="Tell me more.", finish_reason="stop")
    assert verdict.garbage and {"empty_list", "punct_run", "line_loop"} & set(verdict.codes), verdict.to_dict()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50), st.integers(4, 30), st.sampled_from(["{}.", "{})", "({})", "Step {}:", "{}、"]),
       st.sampled_from([" ", "\n", "  "]), opening)
def test_markers_counting_with_nothing_in_them(start, count, style, sep, before):
    text = before + sep + sep.join(style.format(i) for i in range(start, start + count))
    verdict = assess(text, prompt="Tell me more.", finish_reason="length")
    assert verdict.garbage and "empty_list" in verdict.codes, verdict.to_dict()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([*list(",;:!?。、，！？…"), "．"]), st.integers(12, 80), opening, st.booleans())
def test_a_run_of_one_punctuation_mark(mark, count, before, at_end):
    run = mark * count
    text = before + " " + run + ("" if at_end else " " + before)
    verdict = assess(text, prompt="Tell me more.", finish_reason="stop")
    assert verdict.garbage and {"punct_run", "token_loop"} & set(verdict.codes), verdict.to_dict()


# Languages the lexicon does not hold (and one it does, Vietnamese): real sentences. Their short
# words overlap other languages' ("na", "de", "la") by chance; they must not read as salad.
UNLISTED_LANGUAGES = {
    "sw": ('Niambie kuhusu Kenya.',
           'Kenya ni nchi iliyoko Afrika Mashariki. Mji mkuu wake ni Nairobi, na lugha rasmi ni Kiswahili na '
           'Kiingereza. Nchi hii inajulikana kwa mbuga za wanyama, kilimo cha chai na wanariadha hodari wa mbio '
           'ndefu.'),
    "eu": ('Esadazu Bilbori buruz.',
           'Bilbo Bizkaiko hiriburua da eta Euskal Herriko hiri handienetako bat. Guggenheim museoa oso ezaguna '
           'da, eta hiriak itsasadar luze bat du erdialdean. Jende asko etortzen da urtero hiria bisitatzera.'),
    "et": ('Räägi mulle Tallinnast.',
           'Tallinn on Eesti pealinn ja suurim linn. Vanalinn on hästi säilinud ning kuulub UNESCO '
           'maailmapärandi nimekirja. Linnas on palju kohvikuid, muuseume ja parke, mida turistid meelsasti '
           'külastavad.'),
    "eo": ('Rakontu pri Esperanto.',
           'Esperanto estas planlingvo, kiun kreis Ludoviko Zamenhof en la jaro 1887. Ĝi havas regulan '
           'gramatikon kaj simplan prononcon, tial multaj homoj lernas ĝin rapide kaj uzas ĝin por internacia '
           'komunikado.'),
    "la": ('Dic mihi de Roma.',
           'Roma urbs antiqua est et caput imperii Romani fuit. Multi cives in foro conveniebant ut de re '
           'publica disputarent. Hodie peregrini templa, theatra et vias veteres urbis libenter visitant.'),
    "sq": ('Më trego për Tiranën.',
           'Tirana është kryeqyteti i Shqipërisë dhe qyteti më i madh i vendit. Ajo ka shumë parqe, kafene dhe '
           'ndërtesa me ngjyra të ndezura. Çdo vit gjithnjë e më shumë turistë vijnë për ta vizituar.'),
    "vi": ('Hãy kể cho tôi về Hà Nội.',
           'Hà Nội là thủ đô của Việt Nam và có lịch sử hơn một nghìn năm. Thành phố nổi tiếng với phố cổ, hồ '
           'Hoàn Kiếm và nhiều món ăn ngon như phở và bún chả.'),
    "az": ('Bakı haqqında danış.',
           'Bakı Azərbaycanın paytaxtı və ən böyük şəhəridir. Şəhər Xəzər dənizinin sahilində yerləşir və qədim '
           'İçərişəhər hissəsi ilə məşhurdur. Burada müasir binalar tarixi tikililərlə yanaşı durur.'),
    "cy": ('Dywedwch wrthyf am Gaerdydd.',
           "Caerdydd yw prifddinas Cymru a'r ddinas fwyaf yn y wlad. Mae ganddi gastell hanesyddol, stadiwm "
           'enwog a bae prysur lle mae llawer o bobl yn mwynhau cerdded ar benwythnosau.'),
    "ha": ('Faɗa mini game da Kano.',
           'Kano birni ne mai tarihi a arewacin Najeriya. Kasuwar Kurmi ta shahara sosai, kuma mutane da yawa '
           'suna zuwa daga wurare daban daban domin sayen kaya da sayarwa.'),
}


@pytest.mark.parametrize("lang", sorted(UNLISTED_LANGUAGES))
def test_languages_without_a_lexicon_are_not_salad(lang):
    prompt, text = UNLISTED_LANGUAGES[lang]
    verdict = assess(text, prompt=prompt, finish_reason="stop")
    assert not verdict.garbage, verdict.to_dict()
    translated = assess(text, prompt="Translate this paragraph into your language.", finish_reason="stop")
    assert "word_salad" not in translated.codes


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["es", "pt", "it", "fr", "el"]), st.integers(0, 10_000))
def test_a_preposition_and_its_article_at_the_end_is_a_stop(lang, seed):
    """Romance and Greek: "... per la", "... para a" (stop) is unfinished; with a noun after it,
    and a full stop, it is not."""
    from ddtree_diag.checks.quality.patterns import PREPOSITION_ARTICLE

    rng = random.Random(seed)
    preps, articles = (sorted(group) for group in PREPOSITION_ARTICLE[lang])
    body = quality_gen.sentence(rng, lang) + " " + " ".join(quality_gen.words(rng, lang, rng.randint(3, 10)))
    ending = f"{rng.choice(preps)} {rng.choice(articles)}"
    cut = assess(f"{body} {ending}", prompt="Tell me more.", finish_reason="stop")
    assert "premature_stop" in cut.codes, (body, ending)
    noun = quality_gen.words(rng, lang, 1, min_len=5)[0]
    whole = assess(f"{body} {ending} {noun}.", prompt="Tell me more.", finish_reason="stop")
    assert "premature_stop" not in whole.codes, (body, ending, noun)


@pytest.mark.parametrize("last", ["को", "में", "की", "से"])
def test_indic_words_are_read_with_their_vowel_signs(last):
    """"को" is a consonant and a vowel sign: read whole, a Hindi postposition at the end is a stop;
    a sentence closed with a danda is not."""
    body = "भारत एक बड़ा देश है और यहाँ बहुत लोग रहते हैं लेकिन उन्होंने कहा कि सरकार"
    assert "premature_stop" in assess(f"{body} {last}", prompt="मुझे भारत के बारे में बताओ।", finish_reason="stop").codes
    assert not assess(f"{body} काम करती है।", prompt="मुझे भारत के बारे में बताओ।", finish_reason="stop").garbage


@settings(max_examples=40, deadline=None)
@given(opening, st.sampled_from(list(";)]}\"'")), st.integers(4, 12), st.booleans())
def test_the_same_line_of_code_punctuation_again_and_again_is_hollow(before, mark, times, blank_lines):
    """";" or ")" alone on line after line (the same indentation) is no code: code closes its
    brackets at different depths."""
    lines = ("\n\n" if blank_lines else "\n").join([mark] * times)
    verdict = assess(before + "\n" + lines, prompt="Tell me more.", finish_reason="length")
    assert verdict.garbage and "empty_list" in verdict.codes, verdict.codes


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.sampled_from(["{}", "()", "[]"]))
def test_nested_closing_brackets_stay_code(depth, pair):
    opening_, closing = pair
    lines = [f"{'  ' * level}item{level} = {opening_}" for level in range(depth)] + ["  " * depth + "x"]
    lines += [f"{'  ' * level}{closing}" for level in reversed(range(depth))]
    verdict = assess("Here it is:\n" + "\n".join(lines) + "\nDone.", prompt="Write it.", finish_reason="stop")
    assert "empty_list" not in verdict.codes, verdict.codes


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([chr(c) for c in range(0x2500, 0x25A0)] + ["^"]), st.integers(3, 119), opening)
def test_a_line_of_box_drawing_or_a_bar_is_a_drawing(char, width, before):
    verdict = assess(f"{before}\n{char * width}\nThat is the layout.", prompt="Draw it.", finish_reason="stop")
    assert "token_loop" not in verdict.codes, verdict.codes


@settings(max_examples=40, deadline=None)
@given(opening, st.sampled_from(list("*-_=#~")), st.integers(10, 60), opening)
def test_a_spaced_out_run_of_one_mark_mid_line_is_a_run(before, mark, times, after):
    verdict = assess(f"{before} {' '.join([mark] * times)} {after}", prompt="Tell me more.", finish_reason="stop")
    assert "punct_run" in verdict.codes, verdict.codes


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["en", "de", "fr", "es", "pt", "it", "nl", "pl", "ru", "tr"]), st.integers(0, 10_000))
def test_words_split_in_two_throughout_are_salad(lang, seed):
    """Every long word cut in two at a random place ("fa zer", "conv erted") after a fluent
    opening that tells the language: salad, in any of these languages."""
    rng = random.Random(seed)
    ws = quality_gen.words(rng, lang, 30, min_len=6)
    pieces = []
    for word in ws:
        cut = rng.randint(2, len(word) - 2)
        pieces += [word[:cut], word[cut:]]
    verdict = assess(quality_gen.prose(rng, lang, 2, 3) + " " + " ".join(pieces) + ".",
                     prompt=quality_gen.ask(rng, lang), finish_reason="stop")
    assert "word_salad" in verdict.codes, (lang, " ".join(pieces[:12]))


# Real-looking prompts whose few frequent words ("de", "la", "mi") several languages share.
PROMPTS = {
    "de": "Erzähl mir etwas über die Geschichte Berlins.",
    "fr": "Parle-moi de la cuisine française.",
    "pl": "Opowiedz mi o historii Krakowa.",
    "pt": "Fale-me sobre a história de Lisboa.",
    "it": "Parlami della storia di Roma.",
    "ru": "Расскажи мне об истории Москвы.",
    "en": "Tell me about the history of Rome.",
}


@pytest.mark.parametrize("lang", sorted(PROMPTS))
def test_salad_answering_a_short_prompt_is_judged_in_the_prompts_language(lang):
    """A pure salad has too few whole words to tell its language; the prompt tells it, even when
    its frequent words are shared with other languages."""
    caught = 0
    for seed in range(20):
        rng = random.Random(seed)
        caught += assess(quality_gen.salad_text(rng, lang, rng.randint(12, 30)), prompt=PROMPTS[lang],
                         finish_reason="stop").garbage
    assert caught >= 15, (lang, caught)
