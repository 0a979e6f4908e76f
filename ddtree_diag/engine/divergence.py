"""Where two greedy decodes of one engine part, and whether that is a numerics near-tie.

Two decode paths of the same weights (the eager loop and the fast path, or the fast path with and
without a kernel) are equal token for token in fp32. In bf16 their kernels sum in other orders, so
where the target's top two tokens are closer than bf16 can tell apart, either may win: a near-tie,
not a bug. ``first_divergence`` finds the first differing position and asks the plain model (the
HF module's own full forward over the prompt and the shared prefix, no cache, no speculation) how
far apart the two tokens are there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddtree_diag.checks.lossless import DEFAULT_NEAR_TIE_GAP, first_difference_list


@dataclass(frozen=True)
class Divergence:
    index: int  # first output position where the two decodes differ
    reference_token: int
    other_token: int
    gap_nats: float  # log p(reference token) - log p(other token) in the plain forward
    step_nats: float  # one rounding step of the model's dtype at the top logit's magnitude
    threshold_nats: float  # the widest distance from the best token still called a near-tie here
    near_tie: bool  # both tokens are within the threshold of the plain forward's best

    def describe(self) -> str:
        kind = "a near-tie" if self.near_tie else "NOT a near-tie"
        steps = f", {abs(self.gap_nats) / self.step_nats:.1f} rounding steps" if self.step_nats > 1e-6 else ""
        return (f"first differs at output token {self.index} ({self.reference_token} vs {self.other_token}): "
                f"{kind}, {abs(self.gap_nats):.4f} nats apart in the plain forward{steps} "
                f"(near-tie: both within {self.threshold_nats:.4f} of the best)")


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``value``'s magnitude (one unit in the last place)."""
    if not dtype.is_floating_point:
        return 0.0
    info = torch.finfo(dtype)
    exponent = math.frexp(max(abs(value), info.tiny))[1]  # magnitude in [2^(exponent-1), 2^exponent)
    return math.ldexp(info.eps, exponent - 1)


@torch.inference_mode()
def first_divergence(
    model: torch.nn.Module,
    prompt_ids: list[int],
    reference: list[int],
    other: list[int],
    near_tie_gap: float = DEFAULT_NEAR_TIE_GAP,
) -> Divergence | None:
    """The first position where ``other`` leaves ``reference`` (both greedy outputs after
    ``prompt_ids``), judged by ``model`` (an HF causal LM) at that position; None when they agree
    over their common length. A near-tie: both tokens' log-probs are within ``near_tie_gap`` nats
    of the best token's there, or within four rounding steps of the model's dtype at the top
    logit's magnitude, whichever is wider (bf16: 0.125 nats at logits of 4-8, 0.5 at 16-32, where
    the logits themselves are 0.125 apart). Each bf16 layer rounds its sums, so two bf16
    implementations of one network end with logits a few steps apart (on an H200, 27B hybrid
    shape: 3 steps, 0.094 nats, between the fast path and the eager loop); random-weight logits
    are flat enough that three or more tokens often tie, so the two need not be the top two."""
    common = min(len(reference), len(other))
    index = first_difference_list(reference[:common], other[:common])
    if index is None:
        return None
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(reference[:index])], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ref_token, other_token = reference[index], other[index]
    gap = float(logprobs[ref_token] - logprobs[other_token])
    # the model's dtype, not the logits' (a model may hand back fp32 logits of bf16 products)
    step = rounding_step(float(logits.max()), model.dtype)
    threshold = max(near_tie_gap, 4 * step)
    best = float(logprobs.max())
    near = best - float(logprobs[ref_token]) <= threshold and best - float(logprobs[other_token]) <= threshold
    return Divergence(index, ref_token, other_token, gap, step, threshold, near)
