"""Telling a bf16 near-tie from a real divergence between two greedy decodes of one model
(engine/divergence.py), judged by the plain model's own forward on a tiny real checkpoint."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ddtree_diag.engine.divergence import first_divergence, rounding_step  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = pytest.mark.engine
PROMPT = fx.PROMPTS[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = fx.make_target(tmp_path_factory.mktemp("target"))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, len(prompt):].tolist()


def top_two(model, ids: list[int]) -> tuple[tuple[int, int], float]:
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    values, tokens = logprobs.topk(2)
    return (int(tokens[0]), int(tokens[1])), float(values[0] - values[1])


def test_equal_decodes_and_a_prefix_have_no_divergence(model):
    reference = greedy(model, PROMPT, 6)
    assert first_divergence(model, PROMPT, reference, list(reference)) is None
    assert first_divergence(model, PROMPT, reference, reference[:3]) is None  # common length only


def test_the_runner_up_within_the_gap_is_a_near_tie_and_its_gap_is_reported(model):
    reference = greedy(model, PROMPT, 6)
    (best, runner_up), gap = top_two(model, PROMPT + reference[:3])
    assert best == reference[3]
    other = [*reference[:3], runner_up, 0, 0]
    tie = first_divergence(model, PROMPT, reference, other, near_tie_gap=gap + 1e-3)
    assert (tie.index, tie.reference_token, tie.other_token) == (3, best, runner_up)
    assert tie.near_tie and tie.gap_nats == pytest.approx(gap, abs=1e-5)
    assert "a near-tie" in tie.describe() and f"{gap:.4f}" in tie.describe()
    # the same pair with a threshold below their gap (fp32: no rounding step widens it)
    apart = first_divergence(model, PROMPT, reference, other, near_tie_gap=gap / 2)
    assert not apart.near_tie and apart.threshold_nats == pytest.approx(gap / 2)
    assert "NOT a near-tie" in apart.describe()


def test_a_near_tie_is_judged_by_both_tokens_distance_from_the_best(model):
    reference = greedy(model, PROMPT, 4)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    values, tokens = logprobs.topk(3)
    assert int(tokens[0]) == reference[0]
    third, below = int(tokens[2]), float(values[0] - values[2])  # the third token, this far under the best
    other = [third, *reference[1:]]
    # not the top two, yet within the gap of the best: a tie of three is still a near-tie
    tie = first_divergence(model, PROMPT, reference, other, near_tie_gap=below + 1e-3)
    assert tie.index == 0 and tie.near_tie
    assert tie.gap_nats == pytest.approx(below, abs=1e-5)
    assert not first_divergence(model, PROMPT, reference, other, near_tie_gap=below - 1e-3).near_tie
    # the reference token far under the best (here: a reference that did not take the model's choice)
    lowest = int(logprobs.argmin())
    apart = first_divergence(model, PROMPT, [lowest], [reference[0]], near_tie_gap=below + 1e-3)
    assert not apart.near_tie and apart.gap_nats < -1


def test_rounding_steps_of_bf16_widen_the_threshold_at_large_logits():
    assert rounding_step(20.0, torch.bfloat16) == 0.125  # 2^4 * 2^-7
    assert rounding_step(-1.5, torch.bfloat16) == 2**-7
    assert rounding_step(1.0, torch.float32) == 2**-23
    assert rounding_step(3.0, torch.long) == 0.0


def test_a_bf16_model_is_judged_with_its_logits_rounding_step(model):
    half = transformers.AutoModelForCausalLM.from_config(model.config).to(torch.bfloat16).eval()
    half.load_state_dict(model.state_dict())
    reference = greedy(half, PROMPT, 3)
    with torch.inference_mode():
        top = float(half(input_ids=torch.tensor([PROMPT])).logits[0, -1].max())
    other = [(reference[0] + 1) % half.config.vocab_size, *reference[1:]]
    found = first_divergence(half, PROMPT, reference, other, near_tie_gap=0.0)
    assert found.step_nats == rounding_step(top, torch.bfloat16) > 0
    assert found.threshold_nats == 4 * found.step_nats
    assert "rounding steps" in found.describe()
