"""The one decode interface: a ``DecodeRequest`` in, a ``Generation`` out.

Two implementations run the same rounds (prefill, draft, tree, verify, accept/commit):
``eager.EagerDecoder`` (the readable reference loop) and ``fast.FastDecoder`` (static shapes,
device-side tree and accept, CUDA graphs). ``generate.Engine`` builds them and picks one by its
``decode_path`` setting; they read the engine only through ``DecodeContext``, so they do not
import it. Both report through a ``GenerationRecorder``, so stop handling, streaming, max_tokens
clipping and the final record are written once.

Acceptance length of a round = tokens it committed (accepted path + bonus), clipped at a stop token
or ``max_tokens``; the first output token comes from the prefill and belongs to no round, so
sum(acceptance_lengths) == completion_tokens - 1 and decode_rounds == len(acceptance_lengths).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ddtree_diag.engine.draft import DFlashDraft
    from ddtree_diag.engine.grammar import Constraint
    from ddtree_diag.engine.target import TargetModel

# token ids committed by a round, and the text they added -> False cancels the generation
OnToken = Callable[[list[int], str], bool]
# Below this a temperature cannot be sampled with: logits / T overflow to inf and softmax gives NaN
# (vLLM treats T < 1e-5 as greedy; we refuse it and let 0 mean greedy).
MIN_SAMPLING_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes what fits 64 bits, signed or not.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
MODES = ("auto", "ar", "chain", "tree")
STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class DecodeRequest:
    """One generation, after the chat template: what every decoder needs."""

    prompt_ids: list[int]
    mode: str  # resolved: "ar" | "chain" | "tree"
    tree_budget: int  # draft nodes per round (tree mode)
    max_tokens: int
    stop_ids: set[int]
    temperature: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None  # stop strings
    top_logprobs: int = 0
    on_token: OnToken | None = None
    deadline: float | None = None  # a time.perf_counter() value: no round starts after it ("timeout")
    constraint: Constraint | None = None  # grammar.compile_constraint's: every committed token obeys it


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "timeout"
    prompt_tokens: int
    completion_tokens: int
    acceptance_lengths: list[int]  # per round, bonus included
    tree_sizes: list[int]  # draft nodes verified per round (root excluded)
    decode_rounds: int
    stage_times: dict[str, float]  # seconds summed over rounds: draft, tree, verify, commit
    ttft_s: float
    decode_tokens_per_second: float | None
    e2e_s: float
    tree_budget: int
    mode: str  # "ar" | "chain" | "tree"
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, when asked
    token_logprobs: list[float] | None = None  # each output token's own log-prob, when top_logprobs are asked
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


class Decoder(Protocol):
    def decode(self, request: DecodeRequest) -> Generation: ...


class DecodeContext(Protocol):
    """What a decoder reads from whoever builds it (``generate.Engine``): the loaded models, their
    device, and the tokenizer's ``decode_text`` for the output. Stop ids and the rest of a request's
    settings come with each ``DecodeRequest``."""

    target: TargetModel
    draft: DFlashDraft | None
    device: torch.device

    def decode_text(self, token_ids: list[int]) -> str: ...

    @property
    def harmony(self) -> bool: ...  # decode_text rewrites the whole output (not local: no anchor)


class GenerationRecorder:
    """The bookkeeping every decoder shares: output tokens clipped at a stop token and at
    ``max_tokens``, streaming through ``on_token``, stop strings, per-round numbers, timings, and
    the final ``Generation``. ``decode_text(ids)`` turns token ids into text (the tokenizer)."""

    # A long output's text is decoded from an anchor: the whole text of its first tokens (a whole
    # decode, redone every RESYNC_TOKENS) plus the tail's text, decoded with CONTEXT_TOKENS before
    # the anchor and that context's own text cut off (a tokenizer may drop a first token's space or
    # hold a split character). Whole decodes grow with the output (8,192 tokens: 2.4 ms a round on
    # a CPU core), the tail's do not.
    INCREMENTAL_FROM = 256
    RESYNC_TOKENS = 512
    CONTEXT_TOKENS = 8

    def __init__(
        self, request: DecodeRequest, decode_text: Callable[[list[int]], str], incremental: bool = True
    ) -> None:
        """``incremental``: the text of a long output may be decoded from an anchor (see above);
        False where ``decode_text`` is not local (gpt-oss's harmony rewrite reads the whole
        output), so every text is a whole decode."""
        self.request = request
        self.decode_text = decode_text
        self.incremental = incremental
        # (tokens, their text by a whole decode, the text of their last CONTEXT_TOKENS alone)
        self._anchor: tuple[int, str, str] | None = None
        self.output: list[int] = []
        self.acceptance_lengths: list[int] = []
        self.tree_sizes: list[int] = []
        self.stage_times = dict.fromkeys(STAGES, 0.0)
        # per round (top values [n, k], their ids [n, k], the chosen tokens' log-probs [n]), on the
        # logits' device: a vocabulary-wide row per output token would grow without bound (8,192
        # tokens at a 152k vocabulary: 5 GB)
        self.logprob_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.finish: str | None = None
        self.started = time.perf_counter()
        self.ttft = 0.0
        self._streamed = ""
        self._text: tuple[int, str, bool] = (-1, "", True)  # (output tokens, their text, by a whole decode)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output)

    def text(self, exact: bool = False) -> str:
        """The output's text (a stop token at its end left out). The stop-string check and the
        stream both want it each round, so it is decoded once per output length; a long output's
        from its anchor, unless ``exact`` (a whole decode: the final text, a stop string's check)."""
        length, text, whole = self._text
        if length == len(self.output) and (whole or not exact):
            return text
        ids = self.output[:-1] if self.output and self.output[-1] in self.request.stop_ids else self.output
        text = None if exact else self._from_anchor(ids)
        whole = text is None
        if text is None:
            text = self.decode_text(ids)
            self._resync(ids, text)
        self._text = (len(self.output), text, whole)
        return text

    def _from_anchor(self, ids: list[int]) -> str | None:
        """The text of ``ids`` built on the anchor, or None where a whole decode is due (a short
        output, no anchor yet, an anchor RESYNC_TOKENS old, a tail that does not extend its
        context's text)."""
        anchor = self._anchor
        if not self.incremental or anchor is None or len(ids) < self.INCREMENTAL_FROM:
            return None
        if not anchor[0] <= len(ids) < anchor[0] + self.RESYNC_TOKENS:
            return None
        return self._extend(anchor, ids)

    def _extend(self, anchor: tuple[int, str, str], ids: list[int]) -> str | None:
        count, whole, context = anchor
        if len(ids) == count:
            return whole
        tail = self.decode_text(ids[count - self.CONTEXT_TOKENS :])
        return whole + tail[len(context) :] if tail.startswith(context) else None

    def _resync(self, ids: list[int], text: str) -> None:
        """After a whole decode of a long output: if the anchor would have given another text, this
        tokenizer's text is not local and every later text is a whole decode; else the anchor moves
        here (not onto a character split between tokens: its context would not prefix the tail)."""
        if not self.incremental or len(ids) < self.INCREMENTAL_FROM:
            return
        if self._anchor is not None and self._anchor[0] < len(ids):
            predicted = self._extend(self._anchor, ids)
            if predicted is not None and predicted != text:
                self.incremental, self._anchor = False, None
                return
        context = self.decode_text(ids[-self.CONTEXT_TOKENS :])
        if not context.endswith("\ufffd"):
            self._anchor = (len(ids), text, context)

    def first_token(self, token: int, logits: torch.Tensor | None = None, complete: bool = False) -> None:
        """The token the prefill sampled (``logits``: its row, kept when top_logprobs are asked).
        ``complete``: it completed the request's grammar (the generation ends, "stop")."""
        self.ttft = time.perf_counter() - self.started
        if self.request.top_logprobs > 0 and logits is not None:
            self._keep_logprobs([token], logits)
        self._append([token], tree_size=None, complete=complete)

    def round(
        self, new_tokens: list[int], tree_size: int, logits: torch.Tensor | None = None, complete: bool = False
    ) -> None:
        """A decode round committed ``new_tokens`` (path + bonus) after verifying ``tree_size`` nodes;
        ``logits`` [len(new_tokens) or more, V]: the rows that chose them (their top log-probs
        kept when top_logprobs are asked); ``complete``: the last of ``new_tokens`` completed the
        request's grammar ("stop")."""
        if self.request.top_logprobs > 0 and logits is not None:
            self._keep_logprobs(list(new_tokens), logits)
        self._append(list(new_tokens), tree_size, complete)

    def _keep_logprobs(self, tokens: list[int], logits: torch.Tensor) -> None:
        """The top ``top_logprobs`` log-probs of the rows that chose ``tokens`` and the chosen
        tokens' own (a sampled token need not be among the top ones), queued on the logits'
        device; read once, in ``result``."""
        if not tokens:
            return
        rows = logits.reshape(-1, logits.shape[-1])[: len(tokens)]
        logprobs = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
        values, ids = logprobs.topk(min(self.request.top_logprobs, rows.shape[-1]))
        chosen = torch.tensor(tokens, dtype=torch.long)
        # CUDA: from pinned memory, as a pageable copy would wait for the rounds queued ahead
        chosen = chosen.pin_memory().to(rows.device, non_blocking=True) if rows.is_cuda else chosen.to(rows.device)
        self.logprob_parts.append((values, ids, logprobs.gather(-1, chosen[:, None])[:, 0]))

    def add_stage_time(self, stage: str, seconds: float) -> None:
        self.stage_times[stage] += seconds

    def _append(self, new_tokens: list[int], tree_size: int | None, complete: bool = False) -> None:
        request = self.request
        finish = None
        for i, token in enumerate(new_tokens):
            if token in request.stop_ids:
                new_tokens, finish = new_tokens[: i + 1], "stop"
                break
        if len(self.output) + len(new_tokens) >= request.max_tokens:
            complete = complete and len(self.output) + len(new_tokens) == request.max_tokens
            new_tokens = new_tokens[: request.max_tokens - len(self.output)]
            finish = finish or "length"
        if complete:  # the grammar's last token made it in: nothing else may follow
            finish = "stop"
        self.output.extend(new_tokens)
        if tree_size is not None:
            self.acceptance_lengths.append(len(new_tokens))
            self.tree_sizes.append(tree_size)
        # a stop string in a text built on the anchor is confirmed by a whole decode
        if request.stop and finish is None and any(s in self.text() for s in request.stop) \
                and any(s in self.text(exact=True) for s in request.stop):
            finish = "stop"
        if request.on_token is not None:
            delta = self._stream_delta(final=finish is not None)
            if request.on_token(new_tokens, delta) is False:
                finish = finish or "cancelled"
        if finish is None and request.deadline is not None and time.perf_counter() >= request.deadline:
            finish = "timeout"  # checked once per round: the round in flight always completes
        self.finish = finish

    def _stream_delta(self, final: bool) -> str:
        """New text for the stream. A byte-level token can end inside a multi-byte character, which
        decodes as U+FFFD until the next token completes it: such a tail is held back (until the
        last round), so the streamed text always equals the final text."""
        text = self.text(exact=final)
        stable = text if final else text.rstrip("\ufffd")
        if not stable.startswith(self._streamed):
            stable = self._streamed  # never retract what was sent; the rest follows when stable
        delta, self._streamed = stable[len(self._streamed) :], stable
        return delta

    def result(self, extras: dict[str, Any] | None = None) -> Generation:
        """The Generation record: final text cut at a stop string, timings, top log-probs."""
        request = self.request
        e2e = time.perf_counter() - self.started
        text, finish = self.text(exact=True), self.finish or "length"
        cuts = [text.find(s) for s in request.stop or [] if s and s in text]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        decode_time = e2e - self.ttft
        tokens = len(self.output)
        top = chosen = None
        if request.top_logprobs > 0:
            top, chosen = [], []
            if self.logprob_parts:
                parts = zip(*self.logprob_parts, strict=True)
                values, ids, chosen = (torch.cat(part)[:tokens].tolist() for part in parts)
                top = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        return Generation(
            token_ids=self.output,
            text=text,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=tokens,
            acceptance_lengths=self.acceptance_lengths,
            tree_sizes=self.tree_sizes,
            decode_rounds=len(self.acceptance_lengths),
            stage_times=self.stage_times,
            ttft_s=self.ttft,
            decode_tokens_per_second=(tokens - 1) / decode_time if tokens > 1 and decode_time > 0 else None,
            e2e_s=e2e,
            tree_budget=request.tree_budget if request.mode == "tree" else 0,
            mode=request.mode,
            top_logprobs=top,
            token_logprobs=chosen,
            extras=extras or {},
        )


def choose_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """The target's token per row: argmax at T=0, else a seeded sample from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()


def make_generator(temperature: float, seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator for sampling (None at T=0); no seed: a random one."""
    if temperature <= 0:
        return None
    if seed is None:
        seed = int(torch.randint(0, 2**31, ()).item())
    return torch.Generator(device=device).manual_seed(seed)
