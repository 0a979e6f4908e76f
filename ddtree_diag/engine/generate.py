"""The Engine: a loaded target (+ draft), its tokenizer and chat template, stop tokens, and the
choice of decode path. Decoding itself is in ``eager`` (the reference loop) and ``fast``; both
implement ``decode.Decoder`` and read the Engine as a ``decode.DecodeContext``.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree_diag.budget import resolve as resolve_budget
from ddtree_diag.engine.arch import END_OF_TURN_TOKENS, EXPERT_COUNT_FIELDS
from ddtree_diag.engine.decode import (
    MIN_SAMPLING_TEMPERATURE,
    MODES,
    SEED_RANGE,
    Decoder,
    DecodeRequest,
    Generation,
    OnToken,
)
from ddtree_diag.engine.draft import DFlashDraft
from ddtree_diag.engine.grammar import Constraint
from ddtree_diag.engine.target import TargetModel
from ddtree_diag.errors import UsageError, one_line

# END_OF_TURN_TOKENS lives in ``arch``; it stays importable here for callers outside the engine.
__all__ = ["DECODE_PATHS", "DEFAULT_TREE_BUDGET", "END_OF_TURN_TOKENS", "Engine", "Generation"]

DEFAULT_TREE_BUDGET = 64
# eager: the readable reference loop; fast: engine/fast (CUDA graphs on a GPU); fast-nograph: the
# same rounds without graphs; fast-compile: fast + torch.compile'd layer halves and tree build.
DECODE_PATHS = ("eager", "fast", "fast-nograph", "fast-compile")


class Engine:
    """A loaded target (+ optional draft). Build with ``ddtree_diag.engine.load_engine``."""

    def __init__(
        self,
        target: TargetModel,
        tokenizer: Any,
        draft: DFlashDraft | None = None,
        stop_token_ids: list[int] | None = None,
        info: dict[str, Any] | None = None,
        decode_path: str | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.stop_token_ids = sorted(set(stop_token_ids or []))
        self._info = dict(info or {})
        self.device = target.device
        self.dtype = target.dtype
        self.context_length = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 20)
        # The one decode-path setting (see DECODE_PATHS). Default: fast on CUDA (every stage
        # captures as a CUDA graph on the H200), the readable eager loop on CPU.
        self.decode_path = decode_path or ("fast" if self.device.type == "cuda" else "eager")
        self._decoders: dict[str, Decoder] = {}
        # On CUDA every linear stores its weight transposed (cuBLAS reads it faster at a verify's
        # few rows; see fast.layers.store_column_major), before any decode path runs, so that
        # every path, and the HF model itself, computes with one layout.
        from ddtree_diag.engine.fast.layers import column_major_weights, store_models_column_major

        if column_major_weights(self.device):
            store_models_column_major(target.hf, draft)

    # ---- description -------------------------------------------------------------------------
    @property
    def block_size(self) -> int | None:
        return self.draft.config.block_size if self.draft is not None else None

    @property
    def default_tree_budget(self) -> int:
        return DEFAULT_TREE_BUDGET if self.draft is not None else 0

    def _fused_kernels(self) -> bool:
        """Whether the decode path runs the fast path's fused Triton kernels (see fast/kernels)."""
        if self.decode_path == "eager":
            return False
        from ddtree_diag.engine.fast import kernels

        return kernels.active(self.device, self.dtype)

    def _gemm_library(self) -> str | None:
        """The BLAS library the decode path's captured stages run their GEMMs through
        (``fast/graphs.py``); None where it captures none (CPU, eager, fast-nograph) and GEMMs run
        as torch runs them."""
        from ddtree_diag.engine.fast.graphs import blas_plan, blas_switchable

        if self.decode_path not in ("fast", "fast-compile") or self.device.type != "cuda":
            return None
        plan = blas_plan(self.dtype)
        if plan is None:
            return "torch's default (fp32: the eager path's GEMMs)"
        if plan == "auto" and not blas_switchable():
            return "torch's default (this torch build cannot switch BLAS libraries)"
        if plan == "auto":
            return "cuBLAS or cuBLASLt, per draft / verify shape the faster replay at capture"
        return f"{plan} (DDTREE_DIAG_BLAS)"

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
            "decode_path": self.decode_path,
            "fused_kernels": self._fused_kernels(),
            "gemm_library": self._gemm_library(),
            "draft": None,
            "memory": memory,
        }
        sliding = [index for index, window in enumerate(self.target.windows) if window]
        if sliding:  # HF's choice per layer (Qwen2/Qwen3 from max_window_layers on; Mistral all)
            data["sliding_window"] = {
                "tokens": sorted({self.target.windows[index] for index in sliding}), "layers": sliding,
            }
        experts = next(filter(None, (getattr(config, name, None) for name in EXPERT_COUNT_FIELDS)), None)
        if experts:  # the MLP runs as HF's own MoE module
            data["experts"] = {"count": experts, "per_token": getattr(config, "num_experts_per_tok", None)}
        if self.target.arch.attention_sinks:
            data["attention_sinks"] = True
        if self.target.arch.latent_attention:
            data["latent_attention"] = {
                "kv_lora_rank": config.kv_lora_rank, "qk_head_dim": self.target.head_dim,
                "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": self.target.v_head_dim,
            }
        if self.target.hybrid:
            kinds = ["L" if i in self.target.linear_layers else "A" for i in range(self.target.num_layers)]
            data["hybrid"] = {
                "linear_attention_layers": len(self.target.linear_layers),
                "full_attention_layers": len(self.target.attention_layers),
                "layer_pattern": "".join(kinds),  # L: Gated DeltaNet, A: full attention
                # per-node recurrent state the tree scan holds at a budget (bytes)
                "tree_state_bytes": {b: self.target.tree_state_bytes(b) for b in (16, 64, 256)},
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
            try:
                text = tok.apply_chat_template(messages, **kwargs)
            except Exception as exc:  # jinja's TemplateError (raise_exception in the template) and kin
                message = one_line(exc, 200) or type(exc).__name__
                raise UsageError(f"the chat template cannot render these messages: {message}") from None
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
        on_token: OnToken | None = None,
        mode: str = "auto",
        prompt_ids: list[int] | None = None,
        deadline: float | None = None,
        constraint: Constraint | None = None,
    ) -> Generation:
        """Decode one answer. ``mode``: "auto" (tree when a draft is loaded and budget > 0, else AR),
        "ar", "chain" (DFlash: the draft's argmax block) or "tree". ``prompt_ids`` bypasses the
        chat template. ``on_token(new_ids, new_text)`` runs after every round; False cancels.
        ``deadline`` (a ``time.perf_counter()`` value): no round starts after it; the answer so far
        ends with finish_reason "timeout". ``constraint`` (``grammar.compile_constraint``): every
        output token obeys it, in every mode; the answer ends ("stop") where the grammar is complete.
        With a thinking template, compile it with ``thinking=True`` (free text through "</think>")."""
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
            deadline=deadline,
            constraint=constraint,
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

    def generate_ids(
        self,
        prompt_ids: list[int],
        tree_budget: int | None = None,
        temperature: float = 0.0,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: list[str] | None = None,
        top_logprobs: int = 0,
        on_token: OnToken | None = None,
        mode: str = "auto",
        stop_token_ids: list[int] | None = None,
        deadline: float | None = None,
        constraint: Constraint | None = None,
    ) -> Generation:
        """Decode from token ids (no chat template); see ``generate``."""
        budget = resolve_budget(None if tree_budget is None else int(tree_budget), self.default_tree_budget)
        if budget < 0:
            raise UsageError(f"tree_budget must be >= 0, got {budget}")
        if max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {max_tokens}")
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        vocab = self.target.config.vocab_size
        outside = next((token for token in prompt_ids if not 0 <= token < vocab), None)
        if outside is not None:
            raise UsageError(f"prompt token id {outside} is outside the target's vocabulary (0..{vocab - 1})")
        if not 0 <= temperature < float("inf"):  # NaN fails this too
            raise UsageError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if 0 < temperature < MIN_SAMPLING_TEMPERATURE:
            raise UsageError(f"temperature {temperature:g} is too small to sample with (minimum "
                             f"{MIN_SAMPLING_TEMPERATURE:g}; 0 means greedy)")
        if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise UsageError(f"seed must fit in 64 bits ({SEED_RANGE[0]} to {SEED_RANGE[1]}), got {seed}")
        prompt_len = len(prompt_ids)
        if prompt_len >= self.context_length:
            raise UsageError(f"prompt has {prompt_len} tokens, the target's context is {self.context_length}")
        if self.target.hybrid and self._resolve_mode(mode, budget) != "ar":
            self.check_tree_fits(budget)
        request = DecodeRequest(
            prompt_ids=list(prompt_ids),
            mode=self._resolve_mode(mode, budget),
            tree_budget=budget,
            max_tokens=min(max_tokens, self.context_length - prompt_len),
            stop_ids=set(self.stop_token_ids if stop_token_ids is None else stop_token_ids),
            temperature=temperature,
            seed=seed,
            stop=stop,
            top_logprobs=top_logprobs,
            on_token=on_token,
            deadline=deadline,
            constraint=constraint,
        )
        return self.decoder().decode(request)

    def check_tree_fits(self, budget: int) -> None:
        """Refuse, in one line, a tree budget whose per-node recurrent state (hybrid targets, the
        scan of the eager path) does not fit in the free memory of the engine's device."""
        if self.decode_path != "eager":
            return  # the fast path solves the tree in one parallel form: no per-node states
        needed = self.target.tree_state_bytes(max(budget, self.block_size or 1))
        free = free_memory_bytes(self.device)
        if free is not None and needed > 0.9 * free:
            raise UsageError(
                f"tree_budget {budget} needs {needed / 2**30:.1f} GiB of per-node recurrent state on this hybrid "
                f"target, {free / 2**30:.1f} GiB is free on {self.device}: use a smaller budget"
            )

    def use_path(self, path: str) -> None:
        """Select the decode path by name (one of DECODE_PATHS)."""
        if path not in DECODE_PATHS:
            raise ValueError(f"unknown decode path {path!r} (one of {', '.join(DECODE_PATHS)})")
        self.decode_path = path

    def decoder(self, path: str | None = None) -> Decoder:
        """The decoder for ``path`` (default: the engine's setting), made once and kept."""
        path = path or self.decode_path
        if path not in DECODE_PATHS:
            raise ValueError(f"unknown decode path {path!r} (one of {', '.join(DECODE_PATHS)})")
        plan = getattr(self.target, "shard_plan", None)  # engine.parallel: the target is split
        if plan is not None and path != "eager":
            raise UsageError(f"the target is split over {plan.world} devices: only the eager decode path is "
                             f"sharded, not {path!r} (engine/fast, CUDA graphs)")
        if path not in self._decoders:
            if path == "eager":
                from ddtree_diag.engine.eager import EagerDecoder

                self._decoders[path] = EagerDecoder(self)
            else:
                from ddtree_diag.engine.fast import FastDecoder

                graphs = path != "fast-nograph" and self.device.type == "cuda"
                self._decoders[path] = FastDecoder(self, graphs=graphs, torch_compile=path == "fast-compile")
        return self._decoders[path]

    def decode_text(self, token_ids: list[int]) -> str:
        """Text of output token ids (special tokens dropped; a gpt-oss answer's harmony messages
        rewritten by ``harmony_as_think``: its reasoning as a think block, tool calls as tags)."""
        if self.tokenizer is None:
            return ""
        if self.harmony:
            from ddtree_diag.server.parsing import harmony_as_think

            return harmony_as_think(self.tokenizer.decode(token_ids, skip_special_tokens=False))
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def harmony(self) -> bool:
        """Whether the tokenizer speaks gpt-oss's harmony format (``prompting.speaks_harmony``,
        which reads a tokenizer's vocabulary once)."""
        from ddtree_diag.server.prompting import speaks_harmony

        return speaks_harmony(self.tokenizer)

    # ---- baseline ----------------------------------------------------------------------------
    @torch.no_grad()
    def greedy_reference(
        self, prompt_ids: list[int], max_tokens: int, stop_ids: list[int] | None = None
    ) -> list[int]:
        """Target-only greedy decode through HF's own forward and cache (independent of ours)."""
        stops = set(self.stop_token_ids if stop_ids is None else stop_ids)
        hf = self.target.hf
        cache = None  # HF builds the right cache for the model (hybrids keep recurrent state in it)
        input_ids = torch.tensor([prompt_ids], device=self.device)
        output: list[int] = []
        while len(output) < max_tokens:
            result = hf(input_ids=input_ids, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            token = int(result.logits[0, -1].float().argmax())
            output.append(token)
            if token in stops:
                break
            input_ids = torch.tensor([[token]], device=self.device)
        return output


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: the driver's figure; CPU: available RAM), None if unknown."""
    if device.type == "cuda":
        # what the driver has free, plus what torch's allocator holds but does not use
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
