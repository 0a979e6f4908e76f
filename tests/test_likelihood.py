"""The target-likelihood check (checks/likelihood.py).

Two models: the tiny random-weight target (fast: the greedy check's logic, exact in fp32), and
the embedded SmolLM2 (real_model: garbage vs clean separated, a real greedy answer passes and a
perturbed one fails at the perturbed position).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.checks.likelihood import MEAN_HARD, SPAN_HARD, Scorer, likelihood_reasons  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support import quality_gen  # noqa: E402

pytestmark = pytest.mark.engine
MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]


def greedy_answer(engine, messages, max_tokens):
    prompt = engine.render_prompt(messages)
    ids = engine.greedy_reference(prompt, max_tokens)
    stopped = bool(ids) and ids[-1] in engine.stop_token_ids
    return engine.decode_text(ids), stopped


def perturb(engine, scorer, text, messages, rng):
    """Replace one token of a greedy answer by another; return the new text and the character
    where it changed."""
    tok = engine.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    at = rng.randrange(len(ids) // 3, len(ids) - 1)
    prefix = tok.decode(ids[:at])
    for candidate in rng.sample(range(engine.target.config.vocab_size), 200):
        piece = tok.decode([candidate])
        if not piece.strip() or candidate in engine.stop_token_ids or candidate == ids[at]:
            continue
        new_text = prefix + piece + tok.decode(ids[at + 1 :])
        # Only a change that re-tokenizes to itself is a clean test of "this token, here".
        if tok(new_text, add_special_tokens=False)["input_ids"][: at + 1] == [*ids[:at], candidate]:
            return new_text, len(prefix)
    pytest.skip("no clean perturbation found")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    from ddtree_diag.engine import load_engine

    directory = fx.make_target(tmp_path_factory.mktemp("tiny") / "target")
    engine = load_engine(str(directory), device="cpu", dtype="fp32")
    return engine, Scorer(engine, "tiny", own_weights=True)


def greedy_ids(engine, messages, max_tokens):
    return engine.greedy_reference(engine.render_prompt(messages), max_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_tiny_greedy_ids_pass_and_a_changed_token_fails_at_its_position(tiny, seed):
    """The random byte-level model writes special tokens and broken UTF-8: token ids, exact."""
    engine, scorer = tiny
    rng = random.Random(seed)
    words = ["abc", "def", "xyz", "hello", "q"]
    messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(5))}]
    ids = greedy_ids(engine, messages, 24)
    stopped = ids[-1] in engine.stop_token_ids
    assert scorer.score("", messages, stopped=stopped, greedy=True, answer_ids=ids).not_greedy is None
    at = rng.randrange(1, len(ids) - 1)
    changed = [*list(ids[:at]), (ids[at] + rng.randrange(1, 250)) % 250, *list(ids[at + 1:])]
    score = scorer.score("", messages, greedy=True, answer_ids=changed)
    miss = score.not_greedy
    assert miss is not None and miss.token_index == at
    assert miss.argmax_logprob > miss.chosen_logprob and miss.top2_gap >= 0
    [reason] = [r for r in likelihood_reasons(score, greedy=True) if r.code == "not_greedy"]
    assert f"token {at}" in reason.detail and reason.weight >= 0.5


def test_tiny_stop_where_the_model_would_go_on_is_not_greedy(tiny):
    engine, scorer = tiny
    ids = [i for i in greedy_ids(engine, MESSAGES, 24) if i not in engine.stop_token_ids]
    cut = ids[: len(ids) // 2]
    miss = scorer.score("", MESSAGES, stopped=True, greedy=True, answer_ids=cut).not_greedy
    assert miss is not None and miss.at_stop and miss.token_index == len(cut)


# --------------------------------------------------------------------------------------------
# The embedded SmolLM2


@pytest.fixture(scope="module")
def smollm(one_thread):
    pytest.importorskip("gguf")
    torch.set_num_threads(2)
    try:
        return Scorer.load("embedded", own_weights=True)
    except Exception as exc:  # the embedded model's package is missing on this box
        pytest.skip(f"embedded SmolLM2 unavailable: {exc}")


CLEAN_EN = [
    ("Explain photosynthesis in one sentence.",
     "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make "
     "glucose and release oxygen."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra."),
    ("Write a Python function that adds two numbers.",
     "Here is a simple function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nCall it as add(2, 3)."),
    ("Give me three tips for better sleep.",
     "1. Keep a regular schedule.\n2. Avoid screens an hour before bed.\n3. Keep your bedroom cool and dark."),
]


LATIN = {"en", "es", "fr", "de", "it", "pt", "nl", "pl", "tr", "fi", "id", "sv", "cs"}


@pytest.mark.real_model
def test_smollm_separates_garbage_from_clean(smollm):
    clean = [smollm.score(text, [{"role": "user", "content": prompt}], stopped=True) for prompt, text in CLEAN_EN]
    garbage = []
    for klass in ("salad", "glued/split words", "salad after opening"):
        # Latin-script languages: SmolLM2 predicts the byte pieces of scripts it hardly knows too
        # well for salad there to stand out (the model-free word_salad covers those).
        samples = (quality_gen.generate(klass, seed) for seed in range(100))
        latin = [s for s in samples if s.note[:2] in LATIN][:3]
        garbage += [smollm.score(s.text, [{"role": "user", "content": s.prompt}]) for s in latin]
    worst_clean = max(s.mean_surprisal for s in clean)
    assert worst_clean < 3.0, [s.mean_surprisal for s in clean]
    assert min(max(s.mean_surprisal, s.worst_span_surprisal) for s in garbage) > worst_clean + 2
    # Every garbage text gets a low_likelihood reason (soft where SmolLM2 knows the language
    # less: Czech, Finnish), most a hard one; no clean text gets any.
    assert all(any(r.code == "low_likelihood" for r in likelihood_reasons(s, greedy=False)) for s in garbage)
    hard = [s for s in garbage if s.mean_surprisal >= MEAN_HARD or s.worst_span_surprisal >= SPAN_HARD]
    assert len(hard) >= len(garbage) // 2
    assert not any(likelihood_reasons(s, greedy=False) for s in clean)


@pytest.mark.real_model
def test_smollm_greedy_answer_passes_and_a_perturbed_one_fails_at_the_right_place(smollm):
    """Text only, as a server returns it (tokenized again for scoring)."""
    from ddtree_diag.checks.quality import assess

    engine = smollm.engine
    text, stopped = greedy_answer(engine, MESSAGES, 32)
    assert smollm.score(text, MESSAGES, stopped=stopped, greedy=True).not_greedy is None
    finish = "stop" if stopped else "length"
    verdict = assess(text, prompt=MESSAGES[0]["content"], finish_reason=finish, scorer=smollm, temperature=0.0)
    assert not verdict.garbage and "not_greedy" not in verdict.codes
    changed, at = perturb(engine, smollm, text, MESSAGES, random.Random(1))
    miss = smollm.score(changed, MESSAGES, greedy=True).not_greedy
    assert miss is not None and miss.char_index == at, (text, changed, miss)
    verdict = assess(changed, prompt=MESSAGES[0]["content"], finish_reason="length", scorer=smollm, temperature=0.0)
    assert "not_greedy" in verdict.codes
    # Sampled (T > 0): no greedy check.
    sampled = assess(changed, prompt=MESSAGES[0]["content"], finish_reason="length", scorer=smollm, temperature=0.7)
    assert "not_greedy" not in sampled.codes
    # Cut short with a stop where the model would go on.
    words = text.split(" ")
    cut = " ".join(words[: len(words) // 2]).rstrip()  # at a word boundary: the same tokens
    assert smollm.score(cut, MESSAGES, stopped=True, greedy=True).not_greedy.at_stop


def test_probe_engine_score_with_target_runs_the_greedy_check_on_token_ids(tmp_path, cli):
    """--score-with target through the CLI on the in-process engine (tiny random models): the
    engine is lossless, so no answer may be flagged not_greedy; every verdict was scored."""
    target = fx.make_target(tmp_path / "target")
    draft = fx.make_draft(tmp_path / "draft", block_size=4)
    result = cli("probe", "--engine", "--target", str(target), "--draft", str(draft), "--device", "cpu",
                 "--dtype", "fp32", "--score-with", "target", "--thinking", "off", "--budget", "0,8",
                 "--max-tokens", "12", "--json", "-", "--quiet", timeout=600)
    assert result.code in (0, 1), result.stderr  # random weights write gibberish: garbage is fine
    assert "loading" not in result.stderr, "--quiet silences the model loads (target and scorer)"
    report = result.json()
    assert any("greedy check" in note for note in report["notes"])
    for record in report["results"]:
        codes = [r["code"] for r in record["quality"]["reasons"]]
        assert "not_greedy" not in codes, record["quality"]
        # every scored answer shows its figures and the thresholds, flagged or not
        scores = record["quality"]["likelihood"]
        assert scores["greedy_checked"] is True and scores["not_greedy_at_token"] is None
        assert scores["tokens"] > 0 and scores["mean_surprisal"] > 0 and scores["thresholds"]["mean_hard"] > 0
    saved = tmp_path / "run.json"
    saved.write_text(result.stdout)
    shown = cli("report", str(saved))
    assert "target likelihood" in shown.stdout and "nats/token" in shown.stdout
    assert "low_likelihood at >=" in shown.stdout
