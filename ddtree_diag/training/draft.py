"""Train a small DFlash draft for a target by self-distillation (the embedded SmolLM2 draft).

Recipe (facts from the DFlash paper / public training code; the code here is our own):

1. Data: the target's own greedy continuations (T=0, fixture template, thinking off) of a varied
   prompt set, so the draft learns exactly the distribution it is asked to predict at T=0.
2. Context features: the target's hidden states after decoder layers ``target_layer_ids``
   (HF ``hidden_states[id + 1]``), concatenated, recomputed each step with the frozen target.
3. Block-diffusion objective: sample anchor positions in the response; each anchor gives a noise
   block ``[token at anchor, mask x (block_size-1)]`` at positions anchor..anchor+block_size-1.
   The block sees the context features of positions strictly before the anchor (at inference the
   anchor is the last committed token, whose hidden state the target has not computed yet) and
   its own block bidirectionally, never other blocks. Block position k predicts the token at
   anchor+k (k >= 1) through the target's frozen ``lm_head``; cross-entropy weighted by
   exp(-(k-1)/gamma), because an early miss makes every later position worthless.

Many blocks per sequence share one draft forward through a block attention mask, so a step costs
one target forward plus one draft forward over ``batch x anchors x block_size`` queries.

Also here: ``simulate_acceptance`` replays DDTree decoding at T=0 on teacher-forced draft
predictions (the greedy continuation is known, so each round's acceptance follows from the
draft's per-depth distribution alone); the real engine is the reference (bench/bench_default.py).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree_diag.engine.draft import DFlashDraft, DraftConfig, save_draft
from ddtree_diag.engine.tree import build_tree
from ddtree_diag.training.prompts import load_prompts

# <empty_output> (id 16): a StarCoder-era Jupyter marker in SmolLM2's vocabulary that chat never
# produces, so using its embedding as the mask token collides with no real text.
SMOLLM2_MASK_TOKEN_ID = 16


@dataclass
class TrainSettings:
    prompts_file: str
    out_dir: str
    target_dir: str | None = None  # None = the embedded SmolLM2 (ensure_target_dir)
    block_size: int = 8  # beat 16 at budget 64 on held-out prompts (model card)
    num_draft_layers: int = 2
    # None: five layers spread over the target's depth (SmolLM2: 1, 8, 14, 20, 27; a 64-layer
    # Qwen3.6-27B: 1, 16, 31, 46, 61, as z-lab's drafts use)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None  # None: a token id no text uses (see choose_mask_token_id)
    max_prompts: int | None = None
    # > 0: add this many user prompts written by the target itself (sample_user_prompts), kept
    # away from the held-aside evaluation prompts
    sampled_prompts: int = 0
    max_new_tokens: int = 256
    follow_up_tokens: int = 0  # > 0: also generate second turns (FOLLOW_UPS), this long
    follow_ups_per_prompt: int = 1
    gen_batch_size: int = 128
    steps: int = 2000
    max_seconds: float | None = None  # wall-clock cap for the training loop (GPU budget)
    batch_size: int = 32  # sequences per step
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    loss_gamma: float | None = None  # None = 7 for block 16, 5 for 10, 4 for 8 (public DFlash recipe)
    # Draft layers start as copies of the target's last layers (tried: no better than random init).
    init_from_target: bool = False
    # Continue from a trained draft directory (z-lab format) instead of a fresh initialisation.
    init_from: str | None = None
    seed: int = 0
    device: str | None = None
    save_dtype: str = "bfloat16"
    log_every: int = 25
    data_file: str | None = None  # cache of generated token ids (JSON); reused when present
    # Early stopping against memorisation: hold out this fraction of the generated sequences,
    # measure simulated acceptance (budget 64) on them every eval_every_seconds, keep the best.
    val_fraction: float = 0.0
    eval_every_seconds: float = 30.0  # validation time is not counted against max_seconds
    val_sequences: int = 32

    def gamma(self) -> float:
        if self.loss_gamma is not None:
            return self.loss_gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(self.block_size / 2.3, 1.0))


def stop_token_ids(tokenizer) -> list[int]:
    from ddtree_diag.engine.embedded import STOP_TOKENS

    ids = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    return [i for i in ids if i is not None and i >= 0]


def render_prompt_ids(tokenizer, prompt: str | list[dict], enable_thinking: bool) -> list[int]:
    """Token ids of a user prompt (or a whole conversation) with the generation prompt appended."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


SMOKE_PROMPT = "Say hello in one short sentence."  # probes/smoke.toml's prompt


def evaluation_prompts() -> list[str]:
    """The smoke prompt and the packaged held-out prompts: acceptance is measured on them, so
    no training prompt may be one of them (or too close to one)."""
    from importlib import resources

    heldout = resources.files("ddtree_diag").joinpath("data", "prompts", "heldout.txt")
    return [SMOKE_PROMPT, *load_prompts(str(heldout))]


def _generate_left_padded(model, sequences: list[list[int]], pad_id: int, **generate_args) -> list[list[int]]:
    """``model.generate`` over token-id sequences of different lengths (left padding); returns
    each row's new tokens."""
    device = next(model.parameters()).device
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=pad_id, **generate_args
    )
    return [row[width:] for row in out.tolist()]


def _first_stop(tokens: list[int], stops: list[int]) -> int | None:
    """Index of the first stop token in ``tokens``, None when the generation was cut off."""
    return next((pos for pos, tok in enumerate(tokens) if tok in stops), None)


@torch.no_grad()
def generate_greedy(
    model,
    tokenizer,
    prompts: list[str] | list[list[dict]],
    max_new_tokens: int,
    batch_size: int,
    enable_thinking: bool = False,
) -> list[dict]:
    """Greedy continuations, batched with left padding. ``prompts``: user prompts or whole
    conversations (message lists). Each record is ``{"prompt": str | list, "prompt_ids": [...],
    "response_ids": [...]}``; a response ends at its first stop token."""
    stops = stop_token_ids(tokenizer)
    encoded = [(p, render_prompt_ids(tokenizer, p, enable_thinking)) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][1]))  # similar lengths together
    records: list[dict | None] = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        responses = _generate_left_padded(
            model, [encoded[i][1] for i in chunk], stops[0],
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
        )
        for i, response in zip(chunk, responses, strict=True):
            stop_at = _first_stop(response, stops)
            if stop_at is not None:
                response = response[: stop_at + 1]
            records[i] = {"prompt": encoded[i][0], "prompt_ids": encoded[i][1], "response_ids": response}
    return [r for r in records if r is not None]


# Second turns for the self-distillation data: the same prompts give twice the text, and the
# draft sees multi-turn contexts like those a chat probe sends.
FOLLOW_UPS = (
    "Can you explain that more simply?",
    "Give me an example.",
    "Summarize that in one sentence.",
    "Why is that?",
    "Tell me more.",
    "Can you make it shorter?",
    "What else should I know?",
    "Thanks! Can you give me a few more details?",
    "Could you put that as a numbered list?",
    "Is there anything people often get wrong about this?",
    "Can you say that in a more formal tone?",
    "What would be a good next step?",
)


def follow_up_conversations(
    records: list[dict], tokenizer, per_record: int = 1, max_chars: int = 1500
) -> list[list[dict]]:
    """For each first-turn record, ``per_record`` conversations [user, assistant (its greedy
    answer), user (a follow-up)], with different follow-ups."""
    stops = set(stop_token_ids(tokenizer))
    conversations = []
    for index, record in enumerate(records):
        if not isinstance(record["prompt"], str):
            continue
        answer_ids = [t for t in record["response_ids"] if t not in stops]
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()[:max_chars]
        if not answer:
            continue
        for extra in range(per_record):
            follow_up = FOLLOW_UPS[(index * per_record + extra) % len(FOLLOW_UPS)]
            conversations.append(
                [
                    {"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": follow_up},
                ]
            )
    return conversations


# Openers for sampled user turns: starting some turns with a word steers the target away from
# its favourite few question shapes (most unprompted samples begin "What is ...").
PROMPT_OPENERS = (
    "", "", "", "", "How", "Why", "Can you", "Write", "Explain", "Give me", "Describe", "Tell me",
    "List", "I", "My", "What", "Is it", "Should I", "Help me", "Compare", "Summarize", "Create",
    "Suggest", "Which", "When", "Who", "Do you", "Translate", "Make", "Plan",
)


def _user_turn_prefix(tokenizer) -> str:
    """The chat-template text that precedes a user message's content (template-agnostic:
    render a one-message conversation around a sentinel and cut there)."""
    sentinel = "\x00SENTINEL\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": sentinel}], tokenize=False, add_generation_prompt=False
    )
    return text[: text.index(sentinel)]


def _word_set(text: str) -> set[str]:
    # crude normalisation: plural/verb "s" dropped, 1-2 letter words ignored
    words = re.findall(r"\w+", text.lower())
    return {w[:-1] if len(w) > 3 and w.endswith("s") else w for w in words if len(w) > 2}


def too_similar(prompt: str, others: list[str], threshold: float = 0.6) -> bool:
    """True when ``prompt`` shares >= ``threshold`` of its words (Jaccard) with any of ``others``:
    used to keep sampled training prompts away from the held-aside evaluation prompts."""
    words = _word_set(prompt)
    for other in others:
        other_words = _word_set(other)
        union = words | other_words
        if union and len(words & other_words) / len(union) >= threshold:
            return True
    return False


@torch.no_grad()
def sample_user_prompts(
    model,
    tokenizer,
    count: int,
    batch_size: int,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 48,
    exclude: list[str] | None = None,
) -> list[str]:
    """User prompts written by the target itself (the Magpie recipe): sample the content of a user
    turn from the bare user-turn prefix of the chat template, most of them after an opener word.
    Keeps finished turns of 3-60 words, de-duplicated, none too similar to ``exclude``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    stops = stop_token_ids(tokenizer)
    prefix = _user_turn_prefix(tokenizer)
    exclude = exclude or []
    seen: set[str] = set()
    prompts: list[str] = []
    attempts = 0
    while len(prompts) < count and attempts < 4 * count:
        openers = [rng.choice(PROMPT_OPENERS) for _ in range(batch_size)]
        encoded = [tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in openers]
        responses = _generate_left_padded(
            model, encoded, stops[0], max_new_tokens=max_new_tokens, do_sample=True,
            temperature=temperature, top_p=top_p, top_k=0, eos_token_id=stops,
        )
        attempts += batch_size
        for opener, response in zip(openers, responses, strict=True):
            stop_at = _first_stop(response, stops)
            if stop_at is None:
                continue  # cut off mid-sentence
            text = " ".join((opener + tokenizer.decode(response[:stop_at], skip_special_tokens=True)).split())
            key = text.lower()
            if not 3 <= len(text.split()) <= 60 or key in seen or "<|" in text:
                continue
            if too_similar(text, exclude):
                continue
            seen.add(key)
            prompts.append(text)
            if len(prompts) >= count:
                break
    return prompts


def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """[B, T, len(layer_ids) * hidden]: the target's hidden states after the given decoder layers."""
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def pad_batch(records: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Right-padded ids, attention mask, prompt lengths, total lengths."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask, [len(r["prompt_ids"]) for r in records], [len(s) for s in seqs]


def sample_anchors(
    prompt_lens: list[int], seq_lens: list[int], n_anchors: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors in [prompt_len, seq_len-2] (a response token with at least one token after it).
    Returns anchors [B, N] (0 where unused) and a validity mask [B, N]."""
    anchors = torch.zeros((len(seq_lens), n_anchors), dtype=torch.long)
    valid = torch.zeros((len(seq_lens), n_anchors), dtype=torch.bool)
    for row, (p, n) in enumerate(zip(prompt_lens, seq_lens, strict=True)):
        candidates = list(range(p, n - 1))
        chosen = sorted(rng.sample(candidates, min(n_anchors, len(candidates))))
        anchors[row, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        valid[row, : len(chosen)] = True
    return anchors, valid


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[B, 1, N*bs, context_len + N*bs] bool: a block sees the context strictly before its anchor
    and its own block (bidirectionally), never another block."""
    batch, n_blocks = anchors.shape
    device = anchors.device
    q_block = torch.arange(n_blocks * block_size, device=device) // block_size  # [Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx = torch.arange(context_len, device=device)
    see_ctx = ctx.view(1, 1, -1) < q_anchor.unsqueeze(-1)  # [B, Q, S]
    see_block = (q_block.view(-1, 1) == q_block.view(1, -1)).unsqueeze(0).expand(batch, -1, -1)
    return torch.cat([see_ctx, see_block], dim=-1).unsqueeze(1)


def draft_block_hidden(
    draft: DFlashDraft,
    embed_tokens: torch.nn.Module,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    mask_token_id: int,
) -> torch.Tensor:
    """Draft output hidden states for every block: [B, N, block_size, hidden]."""
    bs = draft.block_size
    batch, n_blocks = anchors.shape
    context_len = features.shape[1]
    device = features.device
    noise_ids = torch.full((batch, n_blocks, bs), mask_token_id, dtype=torch.long, device=device)
    noise_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    noise_positions = (anchors.unsqueeze(-1) + torch.arange(bs, device=device)).view(batch, -1)
    context_positions = torch.arange(context_len, device=device)
    param_dtype = draft.fc.weight.dtype
    hidden = draft(
        embed_tokens(noise_ids.view(batch, -1)).to(param_dtype),
        features.to(param_dtype),
        noise_positions,
        context_positions,
        attention_mask=block_attention_mask(anchors, context_len, bs),
    )
    return hidden.view(batch, n_blocks, bs, -1)


def block_loss(
    draft: DFlashDraft,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    seq_lens: list[int],
    anchors: torch.Tensor,
    valid: torch.Tensor,
    mask_token_id: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE over block positions 1..bs-1; also returns per-depth top-1 accuracy [bs-1]."""
    bs = draft.block_size
    device = features.device
    hidden = draft_block_hidden(draft, embed_tokens, features, input_ids, anchors, mask_token_id)
    logits = lm_head(hidden[:, :, 1:].to(lm_head.weight.dtype)).float()  # [B, N, bs-1, V]
    label_pos = anchors.unsqueeze(-1) + torch.arange(1, bs, device=device)  # [B, N, bs-1]
    lens = torch.tensor(seq_lens, device=device).view(-1, 1, 1)
    in_range = (label_pos < lens) & valid.to(device).unsqueeze(-1)
    labels = torch.gather(
        input_ids.unsqueeze(1).expand(-1, anchors.shape[1], -1),
        2,
        label_pos.clamp(max=input_ids.shape[1] - 1),
    )
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    depth_weight = torch.exp(-torch.arange(bs - 1, device=device, dtype=torch.float32) / gamma)
    weights = in_range.float() * depth_weight
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & in_range
        acc = correct.sum((0, 1)).float() / in_range.sum((0, 1)).clamp(min=1).float()
    return loss, acc


def spread_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers from 1 to num_layers-3, evenly spread (z-lab's choice for DFlash)."""
    last = max(1, num_layers - 3)
    ids = [round(1 + i * (last - 1) / max(count - 1, 1)) for i in range(count)]
    return sorted({min(i, num_layers - 1) for i in ids})


def choose_mask_token_id(target_config, tokenizer) -> int:
    """The noise block's mask token: SmolLM2's unused marker for SmolLM2; else the first embedding row
    past the tokenizer (padding rows no text produces), else a mask/pad special."""
    if tokenizer.get_vocab().get("<empty_output>") == SMOLLM2_MASK_TOKEN_ID:
        return SMOLLM2_MASK_TOKEN_ID
    vocab = len(tokenizer)
    if getattr(target_config, "vocab_size", 0) > vocab:
        return vocab
    for token in (getattr(tokenizer, "mask_token", None), "<|mask|>", getattr(tokenizer, "pad_token", None)):
        if token and token in tokenizer.get_vocab():
            return int(tokenizer.get_vocab()[token])
    return target_config.vocab_size - 1


def new_draft(target_config, settings: TrainSettings) -> DFlashDraft:
    cfg = DraftConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=settings.num_draft_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None)
        or target_config.hidden_size // target_config.num_attention_heads,
        intermediate_size=target_config.intermediate_size,
        target_layer_ids=list(settings.target_layer_ids or spread_layer_ids(target_config.num_hidden_layers)),
        mask_token_id=settings.mask_token_id,
        block_size=settings.block_size,
        num_target_layers=target_config.num_hidden_layers,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=_rope_theta(target_config),
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
    )
    return DFlashDraft(cfg)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one table per layer type (Gemma 3): the full layers' base
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


@torch.no_grad()
def init_draft_from_target(draft: DFlashDraft, target) -> None:
    """Start each draft layer as a copy of one of the target's last full-attention layers, and the
    draft's final norm as the target's: its output already lives in the space the frozen lm_head
    reads. A gated query (Qwen3.5/3.6) gives the draft its query half; norms are copied as the
    scale they apply (zero-centred Qwen3.5 norms included); a MoE MLP stays random, as does fc,
    and so does the attention of a target whose projections are not the draft's (latent
    attention)."""
    inner = getattr(target.model, "language_model", target.model)
    sources = [layer for layer in inner.layers if hasattr(layer, "self_attn")][-len(draft.layers) :]
    offset = len(draft.layers) - len(sources)
    for layer, source in zip(draft.layers[offset:], sources, strict=True):
        attn, src = layer.self_attn, source.self_attn
        if all(getattr(src, name, None) is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            query = src.q_proj.weight
            if query.shape[0] == 2 * attn.q_proj.out_features:  # [query | gate] per head
                query = query.view(attn.heads, 2, attn.head_dim, -1)[:, 0].reshape(attn.q_proj.out_features, -1)
            attn.q_proj.weight.copy_(query)
            for name in ("k_proj", "v_proj", "o_proj"):
                getattr(attn, name).weight.copy_(getattr(src, name).weight)
        if hasattr(source.mlp, "gate_proj"):
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        layer.input_layernorm.weight.copy_(_norm_scale(source.input_layernorm))
        layer.post_attention_layernorm.weight.copy_(_norm_scale(source.post_attention_layernorm))
    draft.norm.weight.copy_(_norm_scale(inner.norm))


def _norm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """The per-channel scale an RMSNorm applies (w, or 1 + w for zero-centred norms): its output
    for an all-ones input, whose RMS is 1."""
    ones = torch.ones(1, norm.weight.shape[0], device=norm.weight.device, dtype=torch.float32)
    return norm(ones)[0].to(norm.weight.dtype)


def load_target(target_dir: str | Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


@torch.no_grad()
def depth_topk(
    draft: DFlashDraft,
    target,
    record: dict,
    mask_token_id: int,
    top_k: int = 256,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft log-prob top-k at depths 1..bs-1 for every response anchor of one greedy sequence:
    values/ids [n_response, bs-1, top_k] (anchor i = the i-th response token)."""
    device = next(target.parameters()).device
    ids = torch.tensor([record["prompt_ids"] + record["response_ids"]], device=device)
    features = target_features(target, ids, torch.ones_like(ids), draft.config.target_layer_ids)
    p = len(record["prompt_ids"])
    all_anchors = torch.arange(p, ids.shape[1], device=device)
    values, indices = [], []
    for start in range(0, len(all_anchors), chunk):
        anchors = all_anchors[start : start + chunk].unsqueeze(0)
        hidden = draft_block_hidden(draft, target.get_input_embeddings(), features, ids, anchors, mask_token_id)
        logp = torch.log_softmax(target.lm_head(hidden[0, :, 1:].to(target.lm_head.weight.dtype)).float(), -1)
        v, i = logp.topk(top_k, dim=-1)
        values.append(v.cpu())
        indices.append(i.cpu())
    return torch.cat(values), torch.cat(indices)


def simulate_acceptance(
    response_ids: list[int], values: torch.Tensor, indices: torch.Tensor, budget: int
) -> list[int]:
    """Acceptance length of every DDTree round at T=0 when the target's greedy output is
    ``response_ids`` (the first one comes from prefill). The tree is built from the draft's top-k
    (enough for budget <= top_k); the walk follows the known greedy tokens."""
    n = len(response_ids)
    lengths: list[int] = []
    i = 0  # index of the last committed response token (the round's root)
    while i < n - 1:
        matched = 0
        if budget > 0:
            tree = build_tree(response_ids[i], values[i], budget)
            rank_of = [dict(zip(row.tolist(), range(len(row)), strict=True)) for row in indices[i]]
            node = 0
            while i + matched + 1 < n and matched < values.shape[1]:
                rank = rank_of[matched].get(response_ids[i + matched + 1])
                child = tree.children[node].get(rank) if rank is not None else None
                if child is None:
                    break
                node, matched = child, matched + 1
        step = min(matched + 1, n - 1 - i)
        lengths.append(step)
        i += step
    return lengths


@torch.no_grad()
def validation_acceptance(draft: DFlashDraft, target, records: list[dict], budget: int = 64) -> float:
    """Simulated mean acceptance at ``budget`` on held-back training sequences (first 128 tokens)."""
    lengths: list[int] = []
    for record in records:
        record = {**record, "response_ids": record["response_ids"][:128]}
        values, indices = depth_topk(draft, target, record, draft.config.mask_token_id, budget)
        lengths += simulate_acceptance(record["response_ids"], values, indices, budget)
    return sum(lengths) / max(len(lengths), 1)


def _keep_best(draft, target, val_records, settings, best: dict, step: int, log) -> None:
    was_training = draft.training
    draft.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=next(draft.parameters()).is_cuda):
        score = validation_acceptance(draft, target, val_records)
    draft.train(was_training)
    log(json.dumps({"step": step, "val_acceptance_b64": round(score, 3)}))
    if best["val_acceptance"] is None or score > best["val_acceptance"]:
        best.update(
            val_acceptance=score, step=step, state={k: v.clone() for k, v in draft.state_dict().items()}
        )


def _lr_at(progress: float, settings: TrainSettings, step: int) -> float:
    warm = min(1.0, (step + 1) / max(settings.warmup_steps, 1))
    return settings.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def check_against_target(settings: TrainSettings, target) -> None:
    """Layer ids and the mask token must exist in the target: said before any generation."""
    from ddtree_diag.engine.arch import text_config
    from ddtree_diag.errors import UsageError

    config = text_config(target.config)
    layers = config.num_hidden_layers
    if settings.target_layer_ids and max(settings.target_layer_ids) >= layers:
        raise UsageError(f"--target-layers {','.join(map(str, settings.target_layer_ids))}: the target has "
                         f"{layers} layers (ids 0-{layers - 1})")
    if settings.mask_token_id is not None and settings.mask_token_id >= config.vocab_size:
        raise UsageError(f"--mask-token-id {settings.mask_token_id}: the target's vocabulary has "
                         f"{config.vocab_size} ids")


def train_draft(settings: TrainSettings, log=print) -> dict:
    """Generate data (or reuse ``data_file``), train, save the draft to ``out_dir``; returns a summary."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    target_dir = settings.target_dir
    if target_dir is None:
        from ddtree_diag.engine.embedded import ensure_target_dir

        target_dir = str(ensure_target_dir())
    target, tokenizer = load_target(target_dir, device)
    check_against_target(settings, target)
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    data_path = Path(settings.data_file) if settings.data_file else None
    if data_path is not None and data_path.is_file():
        records = json.loads(data_path.read_text())
        log(f"reusing {len(records)} generated sequences from {data_path}")
    else:
        prompts = load_prompts(settings.prompts_file)[: settings.max_prompts]
        t0 = time.time()
        if settings.sampled_prompts > 0:
            before = len(prompts)
            prompts += sample_user_prompts(
                target, tokenizer, settings.sampled_prompts, settings.gen_batch_size, seed=settings.seed + 1,
                temperature=0.9, exclude=evaluation_prompts(),
            )
            log(f"sampled {len(prompts) - before} user prompts")
        records = generate_greedy(
            target, tokenizer, prompts, settings.max_new_tokens, settings.gen_batch_size
        )
        if settings.follow_up_tokens > 0:
            conversations = follow_up_conversations(records, tokenizer, settings.follow_ups_per_prompt)
            records += generate_greedy(
                target, tokenizer, conversations, settings.follow_up_tokens, settings.gen_batch_size
            )
        n_tokens = sum(len(r["response_ids"]) for r in records)
        log(f"generated {len(records)} greedy continuations, {n_tokens} tokens, {time.time() - t0:.1f}s")
        if data_path is not None:
            data_path.parent.mkdir(parents=True, exist_ok=True)
            data_path.write_text(json.dumps(records))
    records = [r for r in records if len(r["response_ids"]) >= 2]
    val_records: list[dict] = []
    if settings.val_fraction > 0:
        shuffled = records[:]
        random.Random(settings.seed + 1).shuffle(shuffled)
        n_val = max(1, int(len(shuffled) * settings.val_fraction))
        val_records, records = shuffled[:n_val][: settings.val_sequences], shuffled[n_val:]

    from ddtree_diag.engine.arch import text_config

    target_config = text_config(target.config)  # a vision-language checkpoint: its language model's
    if settings.target_layer_ids is None:
        settings.target_layer_ids = spread_layer_ids(target_config.num_hidden_layers)
    if settings.mask_token_id is None:
        settings.mask_token_id = choose_mask_token_id(target_config, tokenizer)
    log(f"target layers {settings.target_layer_ids}, mask token {settings.mask_token_id}")
    draft = new_draft(target_config, settings).to(device)
    if settings.init_from:
        from ddtree_diag.engine.draft import load_draft

        start = load_draft(settings.init_from, device=device)
        draft.load_state_dict(start.state_dict())
        log(f"continuing from {settings.init_from}")
    elif settings.init_from_target:
        init_draft_from_target(draft, target)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    use_bf16 = device.startswith("cuda")
    pad_id = stop_token_ids(tokenizer)[0]
    history = []
    best: dict = {"val_acceptance": None}
    last_eval = time.time()
    eval_seconds = 0.0
    t_start = time.time()
    step = 0
    for step in range(settings.steps):
        elapsed = time.time() - t_start - eval_seconds
        progress = step / settings.steps
        if settings.max_seconds:
            progress = max(progress, elapsed / settings.max_seconds)
            if progress >= 1.0:
                break
        lr = _lr_at(progress, settings, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = rng.sample(records, min(settings.batch_size, len(records)))
        ids, mask, prompt_lens, seq_lens = pad_batch(batch, pad_id)
        ids, mask = ids.to(device), mask.to(device)
        anchors, valid = sample_anchors(prompt_lens, seq_lens, settings.anchors_per_seq, rng)
        anchors, valid = anchors.to(device), valid.to(device)
        with torch.no_grad():
            features = target_features(target, ids, mask, settings.target_layer_ids)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            loss, acc = block_loss(
                draft,
                target.get_input_embeddings(),
                target.lm_head,
                features,
                ids,
                seq_lens,
                anchors,
                valid,
                settings.mask_token_id,
                settings.gamma(),
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        if step % settings.log_every == 0 or step == settings.steps - 1:
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "lr": round(lr, 7),
                "acc_d1": round(acc[0].item(), 3),
                "acc_d4": round(acc[min(3, len(acc) - 1)].item(), 3),
                "seconds": round(time.time() - t_start, 1),
            }
            history.append(entry)
            log(json.dumps(entry))
        if val_records and time.time() - last_eval >= settings.eval_every_seconds:
            eval_start = time.time()
            _keep_best(draft, target, val_records, settings, best, step, log)
            last_eval = time.time()
            eval_seconds += last_eval - eval_start
    steps_done = step + 1
    if val_records:
        _keep_best(draft, target, val_records, settings, best, step, log)
        draft.load_state_dict(best["state"])
        log(f"kept the step-{best['step']} draft: validation acceptance {best['val_acceptance']:.3f}")
        del best["state"]
    draft.eval()
    save_dtype = getattr(torch, settings.save_dtype)
    save_draft(draft.to(save_dtype), None, out_dir)
    summary = {
        "settings": asdict(settings),
        "steps_done": steps_done,
        "train_seconds": round(time.time() - t_start, 1),
        "sequences": len(records),
        "response_tokens": sum(len(r["response_ids"]) for r in records),
        "final": history[-1] if history else None,
        "validation": {k: v for k, v in best.items() if k != "state"} if val_records else None,
    }
    (out_dir / "train_log.json").write_text(json.dumps({"summary": summary, "history": history}, indent=1))
    draft.to(torch.float32)
    return {"summary": summary, "draft": draft, "target": target, "tokenizer": tokenizer}


def evaluate(
    draft: DFlashDraft,
    target,
    tokenizer,
    prompts: list[str] | None,
    budgets: list[int],
    max_new_tokens: int = 128,
    thinking: tuple[bool, ...] = (False, True),
    records_by_mode: dict[bool, list[dict]] | None = None,
) -> dict:
    """Simulated mean acceptance (committed tokens / rounds, pooled over prompts) per
    (thinking, budget). ``records_by_mode`` reuses greedy sequences generated once."""
    table = {}
    for enable_thinking in thinking:
        if records_by_mode is not None and enable_thinking in records_by_mode:
            records = records_by_mode[enable_thinking]
        else:
            records = generate_greedy(target, tokenizer, prompts or [], max_new_tokens, 64, enable_thinking)
        per_budget: dict[int, list[int]] = {b: [] for b in budgets}
        for record in records:
            if len(record["response_ids"]) < 2:
                continue
            values, indices = depth_topk(
                draft, target, record, draft.config.mask_token_id, max(max(budgets), 1)
            )
            for b in budgets:
                per_budget[b] += simulate_acceptance(record["response_ids"], values, indices, b)
        table[f"thinking={'on' if enable_thinking else 'off'}"] = {
            str(b): round(sum(v) / len(v), 3) if v else None for b, v in per_budget.items()
        }
    return table
