"""The one decode loop: prefill, draft, tree, verify, accept/commit — AR, DFlash chain and DDTree.

Round r (``start`` = tokens in the target cache, the root = last committed token at ``start``):
1. draft: noise block [root, mask × (block_size-1)] at positions start.., with the context
   features of the tokens committed since the last round → per-depth log-probs (depths 1..D).
2. tree: best-first tree under ``tree_budget`` (chain mode: the draft's argmax path; AR: no nodes).
3. verify: one target forward over root + nodes, ancestor-only mask, positions start + depth.
4. commit: walk from the root while the target's choice (argmax, or a seeded sample at T > 0) is a
   child; commit the path plus the target's next token (the bonus); keep only the root's and the
   accepted nodes' K/V (compacted in order) and their hidden states as the next draft context.

Acceptance length of a round = tokens it committed (path + bonus), clipped at a stop token or
``max_tokens``; the first output token comes from the prefill and belongs to no round, so
sum(acceptance_lengths) == completion_tokens - 1 and decode_rounds == len(acceptance_lengths).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree_diag.engine.draft import DFlashDraft
from ddtree_diag.engine.target import TargetModel
from ddtree_diag.engine.tree import DraftTree, accept_walk, ancestor_mask, build_tree, chain_tree
from ddtree_diag.errors import UsageError

MODES = ("auto", "ar", "chain", "tree")
DEFAULT_TREE_BUDGET = 64
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
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
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


class Engine:
    """A loaded target (+ optional draft). Build with ``ddtree_diag.engine.load_engine``."""

    def __init__(
        self,
        target: TargetModel,
        tokenizer: Any,
        draft: DFlashDraft | None = None,
        stop_token_ids: list[int] | None = None,
        info: dict[str, Any] | None = None,
        fast: bool | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.stop_token_ids = sorted(set(stop_token_ids or []))
        self._info = dict(info or {})
        self.device = target.device
        self.dtype = target.dtype
        self.context_length = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 20)
        self._draft_cache = None
        # fast: the static-shape rounds of engine/fast.py (CUDA graphs on a GPU); None = on CUDA
        # only, so the CPU path stays this readable loop unless asked for.
        self.fast = (self.device.type == "cuda") if fast is None else bool(fast)
        # CUDA-graph capture of the fast path's stages (on a GPU). Every stage captures on the H200
        # (bench/RESULTS-engine.md); a stage that cannot runs eagerly and says so in the extras.
        self.cuda_graphs = True
        # torch.compile the decoder-layer halves inside the fast path (CUDA; opt-in, see fast.py)
        self.torch_compile = False
        self._fast_decoder = None

    # ---- description -------------------------------------------------------------------------
    @property
    def block_size(self) -> int | None:
        return self.draft.config.block_size if self.draft is not None else None

    @property
    def default_tree_budget(self) -> int:
        return DEFAULT_TREE_BUDGET if self.draft is not None else 0

    def info(self) -> dict[str, Any]:
        params = sum(p.numel() * p.element_size() for p in self.target.hf.parameters())
        draft_params = 0
        if self.draft is not None:
            draft_params = sum(p.numel() * p.element_size() for p in self.draft.parameters())
        memory = {"target_weights_bytes": params, "draft_weights_bytes": draft_params}
        if self.device.type == "cuda":
            memory["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            memory["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        config = self.target.config
        data = {
            "model_type": config.model_type,
            "layers": self.target.num_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "context_length": self.context_length,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "stop_token_ids": self.stop_token_ids,
            "default_tree_budget": self.default_tree_budget,
            "draft": None,
            "memory": memory,
        }
        if self.draft is not None:
            dc = self.draft.config
            data["draft"] = {
                "layers": dc.num_hidden_layers,
                "target_layer_ids": list(dc.target_layer_ids),
                "mask_token_id": dc.mask_token_id,
                "block_size": dc.block_size,
                "heads": dc.num_attention_heads,
                "kv_heads": dc.num_key_value_heads,
                "head_dim": dc.dim_per_head,
            }
        data.update(self._info)
        return data

    # ---- prompts -----------------------------------------------------------------------------
    def render_prompt(self, messages: list[dict[str, Any]], enable_thinking: bool | None = None) -> list[int]:
        """Chat template of the target (``enable_thinking`` passed when not None; templates that
        ignore it simply render without it). No template: a plain "role: content" transcript."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
            if enable_thinking is not None:
                kwargs["enable_thinking"] = enable_thinking
            text = tok.apply_chat_template(messages, **kwargs)
        else:
            text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant:"
        return list(tok(text, add_special_tokens=False)["input_ids"])

    # ---- decoding ----------------------------------------------------------------------------
    def generate(
        self,
        messages: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        tree_budget: int | None = None,
        temperature: float = 0.0,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: list[str] | None = None,
        top_logprobs: int = 0,
        on_token: Callable[[list[int], str], bool] | None = None,
        mode: str = "auto",
        prompt_ids: list[int] | None = None,
    ) -> Generation:
        """Decode one answer. ``mode``: "auto" (tree when a draft is loaded and budget > 0, else AR),
        "ar", "chain" (DFlash: the draft's argmax block) or "tree". ``prompt_ids`` bypasses the
        chat template. ``on_token(new_ids, new_text)`` runs after every round; False cancels."""
        if prompt_ids is None:
            if messages is None:
                raise UsageError("generate needs messages or prompt_ids")
            prompt_ids = self.render_prompt(messages, enable_thinking)
        return self.generate_ids(
            prompt_ids,
            tree_budget=tree_budget,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            top_logprobs=top_logprobs,
            on_token=on_token,
            mode=mode,
        )

    def _resolve_mode(self, mode: str, budget: int) -> str:
        if mode not in MODES:
            raise UsageError(f"unknown decoding mode {mode!r} (choose from {', '.join(MODES)})")
        if mode in ("chain", "tree") and self.draft is None:
            raise UsageError(f"{mode} mode needs a draft model")
        if mode == "auto":
            return "tree" if self.draft is not None and budget > 0 else "ar"
        if mode == "tree" and budget <= 0:
            return "ar"
        return mode

    def _choose(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> list[int]:
        """Target's token per row: argmax at T=0, else a seeded sample from softmax(logits / T)."""
        if temperature <= 0:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()

    def _draft_logprobs(
        self, root: int, start: int, context: torch.Tensor, context_positions: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """Per-depth draft log-probs [depth, V] for positions start+1 .. start+depth."""
        assert self.draft is not None and self._draft_cache is not None
        block = self.draft.config.block_size
        noise_ids = torch.full((1, block), self.draft.config.mask_token_id, device=self.device)
        noise_ids[0, 0] = root
        positions = torch.arange(start, start + block, device=self.device)
        with torch.no_grad():
            hidden = self.draft(
                self.target.embed(noise_ids),
                context[None],
                positions,
                context_positions,
                kv_cache=self._draft_cache,
            )
            logits = self.target.lm_head(hidden[0, 1 : 1 + depth])
        return torch.log_softmax(logits.float(), dim=-1)

    def generate_ids(
        self,
        prompt_ids: list[int],
        tree_budget: int | None = None,
        temperature: float = 0.0,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: list[str] | None = None,
        top_logprobs: int = 0,
        on_token: Callable[[list[int], str], bool] | None = None,
        mode: str = "auto",
        stop_token_ids: list[int] | None = None,
    ) -> Generation:
        budget = self.default_tree_budget if tree_budget is None else int(tree_budget)
        if budget < 0:
            raise UsageError(f"tree_budget must be >= 0, got {budget}")
        if max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {max_tokens}")
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        mode = self._resolve_mode(mode, budget)
        prompt_len = len(prompt_ids)
        if prompt_len >= self.context_length:
            raise UsageError(f"prompt has {prompt_len} tokens, the target's context is {self.context_length}")
        max_tokens = min(max_tokens, self.context_length - prompt_len)
        stops = set(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        if self.fast:
            return self._fast().generate_ids(
                prompt_ids, budget, mode, temperature, max_tokens, seed, stop, top_logprobs, on_token, stops
            )
        block = self.draft.config.block_size if self.draft is not None else 1
        feature_layers = list(self.draft.config.target_layer_ids) if mode != "ar" else None
        generator = None
        if temperature > 0:
            generator = torch.Generator().manual_seed(
                seed if seed is not None else int(torch.randint(0, 2**31, ()).item())
            )
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        capacity = prompt_len + max_tokens + max(budget, block) + 2
        self.target.reset(capacity)
        if mode != "ar":
            if self._draft_cache is None or self._draft_cache.max_len < capacity:
                self._draft_cache = self.draft.new_cache(capacity)
            self._draft_cache.reset()

        stage_times = {"draft": 0.0, "tree": 0.0, "verify": 0.0, "commit": 0.0}
        t_start = time.perf_counter()
        prompt = torch.tensor(prompt_ids, device=self.device)
        positions = torch.arange(prompt_len, device=self.device)
        logits, features = self.target.forward(prompt, positions, None, feature_layers)
        self.target.commit(list(range(prompt_len)))
        last_logits = logits[-1:].float()
        first = self._choose(last_logits, temperature, generator)[0]
        sync()
        ttft = time.perf_counter() - t_start

        output = [first]
        logprob_rows = [last_logits[0]] if top_logprobs > 0 else []
        context, context_positions = features, positions
        acceptance_lengths: list[int] = []
        tree_sizes: list[int] = []
        finish, text_so_far = self._after_first_token(first, stops, max_tokens, on_token)

        while finish is None:
            start = self.target.length
            root = output[-1]
            remaining = max_tokens - len(output)
            depth = min(block - 1, remaining - 1)  # deeper nodes could never be committed
            t0 = time.perf_counter()
            tree: DraftTree
            if mode == "ar" or depth <= 0:
                tree = chain_tree(root, [])
                t1 = t0
            else:
                depth_logprobs = self._draft_logprobs(root, start, context, context_positions, depth)
                sync()
                t1 = time.perf_counter()
                if mode == "chain":
                    tree = chain_tree(root, depth_logprobs.argmax(dim=-1).tolist())
                else:
                    tree = build_tree(root, depth_logprobs, budget)
            tokens = torch.tensor(tree.tokens, device=self.device)
            node_positions = torch.tensor(tree.depths, device=self.device) + start
            mask = ancestor_mask(tree.parents, self.device)
            t2 = time.perf_counter()
            logits, features = self.target.forward(tokens, node_positions, mask, feature_layers)
            choice = self._choose(logits, temperature, generator)
            sync()
            t3 = time.perf_counter()
            path, bonus = accept_walk(tree, choice)
            keep = [0, *path]
            self.target.commit(keep)
            new_tokens = [tree.tokens[n] for n in path] + [bonus]
            if top_logprobs > 0:
                logprob_rows.extend(logits[keep].float())
            if feature_layers is not None:
                keep_index = torch.tensor(keep, device=self.device)
                context, context_positions = features[keep_index], node_positions[keep_index]
            finish, text_so_far, committed = self._after_round(
                output, new_tokens, stops, stop, max_tokens, on_token, text_so_far
            )
            acceptance_lengths.append(committed)
            tree_sizes.append(tree.size)
            t4 = time.perf_counter()
            stage_times["draft"] += t1 - t0
            stage_times["tree"] += t2 - t1
            stage_times["verify"] += t3 - t2
            stage_times["commit"] += t4 - t3

        return self.assemble(
            output, stops, stop, finish, prompt_len, t_start, ttft, acceptance_lengths, tree_sizes,
            stage_times, logprob_rows, top_logprobs, budget if mode == "tree" else 0, mode,
        )  # fmt: skip

    def _after_first_token(
        self, first: int, stops: set[int], max_tokens: int, on_token: Callable[[list[int], str], bool] | None
    ) -> tuple[str | None, str]:
        """(finish reason or None, text so far) once the prefill has sampled the first token."""
        finish = "stop" if first in stops else "length" if max_tokens <= 1 else None
        text_so_far = ""
        if on_token is not None:
            text_so_far = self._text([first], stops)
            if on_token([first], text_so_far) is False:
                finish = finish or "cancelled"
        return finish, text_so_far

    def _after_round(
        self,
        output: list[int],
        new_tokens: list[int],
        stops: set[int],
        stop: list[str] | None,
        max_tokens: int,
        on_token: Callable[[list[int], str], bool] | None,
        text_so_far: str,
    ) -> tuple[str | None, str, int]:
        """Append a round's tokens to ``output``, clipped at the first stop token and at
        ``max_tokens``; stream them; check stop strings. Returns (finish reason or None, text so
        far, tokens committed) — the same bookkeeping for the eager and the fast loop."""
        finish = None
        for i, token in enumerate(new_tokens):
            if token in stops:
                new_tokens, finish = new_tokens[: i + 1], "stop"
                break
        if len(output) + len(new_tokens) >= max_tokens:
            new_tokens = new_tokens[: max_tokens - len(output)]
            finish = finish or "length"
        output.extend(new_tokens)
        if on_token is not None:
            text = self._text(output, stops)
            delta, text_so_far = text[len(text_so_far) :], text
            if on_token(new_tokens, delta) is False:
                finish = finish or "cancelled"
        if stop and finish is None and any(s in self._text(output, stops) for s in stop):
            finish = "stop"
        return finish, text_so_far, len(new_tokens)

    def assemble(
        self,
        output: list[int],
        stops: set[int],
        stop: list[str] | None,
        finish: str,
        prompt_len: int,
        t_start: float,
        ttft: float,
        acceptance_lengths: list[int],
        tree_sizes: list[int],
        stage_times: dict[str, float],
        logprob_rows: list[torch.Tensor],
        top_logprobs: int,
        tree_budget: int,
        mode: str,
        extras: dict[str, Any] | None = None,
    ) -> Generation:
        """The Generation record at the end of a decode (eager and fast paths alike): final text
        cut at a stop string, timings, and the per-token top log-probs when asked."""
        e2e = time.perf_counter() - t_start
        text = self._text(output, stops)
        if stop:
            cuts = [text.find(s) for s in stop if s and s in text]
            if cuts:
                text, finish = text[: min(cuts)], "stop"
        decode_time = e2e - ttft
        top = None
        if top_logprobs > 0:
            top = []
            for row in logprob_rows[: len(output)]:
                values, ids = torch.log_softmax(row, dim=-1).topk(top_logprobs)
                top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        return Generation(
            token_ids=output,
            text=text,
            finish_reason=finish,
            prompt_tokens=prompt_len,
            completion_tokens=len(output),
            acceptance_lengths=acceptance_lengths,
            tree_sizes=tree_sizes,
            decode_rounds=len(acceptance_lengths),
            stage_times=stage_times,
            ttft_s=ttft,
            decode_tokens_per_second=(len(output) - 1) / decode_time if len(output) > 1 and decode_time > 0 else None,
            e2e_s=e2e,
            tree_budget=tree_budget,
            mode=mode,
            top_logprobs=top,
            extras=extras or {},
        )

    DECODE_PATHS = ("eager", "fast", "fast-nograph", "fast-compile")

    def use_path(self, path: str) -> None:
        """Select a decode path by name: ``eager`` (the readable reference loop), ``fast``
        (engine/fast.py, CUDA graphs on a GPU), ``fast-nograph`` (the same rounds, no graphs),
        ``fast-compile`` (fast + torch.compile'd layer halves and tree build)."""
        if path not in self.DECODE_PATHS:
            raise ValueError(f"unknown decode path {path!r} (one of {', '.join(self.DECODE_PATHS)})")
        self.fast = path != "eager"
        self.cuda_graphs = path in ("fast", "fast-compile")
        self.torch_compile = path == "fast-compile"

    def _fast(self):
        graphs = self.cuda_graphs and self.device.type == "cuda"
        decoder = self._fast_decoder
        if decoder is None or decoder.graphs != graphs or decoder.torch_compile != self.torch_compile:
            from ddtree_diag.engine.fast import FastDecoder

            self._fast_decoder = FastDecoder(self, graphs=graphs, torch_compile=self.torch_compile)
        return self._fast_decoder

    def _text(self, token_ids: list[int], stops: set[int]) -> str:
        if self.tokenizer is None:
            return ""
        if token_ids and token_ids[-1] in stops:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- baseline ----------------------------------------------------------------------------
    @torch.no_grad()
    def greedy_reference(
        self, prompt_ids: list[int], max_tokens: int, stop_ids: list[int] | None = None
    ) -> list[int]:
        """Target-only greedy decode through HF's own forward and cache (independent of ours)."""
        from transformers import DynamicCache

        stops = set(self.stop_token_ids if stop_ids is None else stop_ids)
        hf = self.target.hf
        cache = DynamicCache()
        input_ids = torch.tensor([prompt_ids], device=self.device)
        output: list[int] = []
        while len(output) < max_tokens:
            logits = hf(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[0, -1]
            token = int(logits.float().argmax())
            output.append(token)
            if token in stops:
                break
            input_ids = torch.tensor([[token]], device=self.device)
        return output
