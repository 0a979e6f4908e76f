"""Fast decode rounds: static shapes, device-side tree and accept, one host sync per round.

The eager loop (``eager.py``) stays the readable reference; this module runs the same rounds
with the same outputs (T=0: token for token; T>0 on CPU: the same seeded draws) but shaped for a
GPU, gpt-fast style:

- Static KV caches (the target's ``target.KVCache``, the draft's here) written in place with
  ``index_copy_`` at slot tensors, and attention over a window [0, window) of the preallocated
  cache (the used slots rounded up to ``WINDOW``) with a mask built on the device from a
  cache-length tensor. Shapes change only when the window grows, so kernels do not re-plan and
  every stage is captured once per window as a CUDA graph. Where the fused kernels run, the
  verify/AR rows' attention is one split-key Triton kernel (``triton_attention``) reading the
  cache length and the ancestor mask itself instead of SDPA with a bias (the draft's noise block
  runs the same kernel on its boolean masks), and a hybrid target's
  Gated DeltaNet layers run their tree rows' conv, parallel solve and state commit as one Triton
  kernel each (``triton_gdn_state``, ``triton_gdn``) instead of ~60 small PyTorch ops.
- q|k|v and gate|up projections run as one GEMM each (``FusedWeights``).
- One verify shape a request: budget + 1 rows, the tree padded to its budget in the last rounds
  only (no rounding up: at 257 rows the GEMMs and kernels do less than at 272).
- The best-first tree is built with tensor ops (``build_tree_tensors``), reproducing
  ``tree.build_tree``'s node order and tie-breaking exactly (see its docstring for why); when it
  cannot prove its order (a tie it could not resolve), the round is redone with the exact host
  build — counted in ``Generation.extras["fast_tree_fallbacks"]``. Where the Triton kernels run
  (CUDA by default, ``kernels.tree_kernel``), one Triton program runs the heap itself instead
  (``triton_tree``: exact by construction, never falls back).
- Accept walk, KV compaction (``KVCache.compact``) and the next round's draft context are device
  ops; the host reads one small tensor per round (accepted count, bonus, kept nodes, their tokens).
  Before it waits for that read, it launches the next round's first stages where their shape
  cannot depend on it (``_round_ahead``: the draft; for AR the whole forward), so the GPU does not
  idle while the host does a round's bookkeeping. ``DDTREE_DIAG_ROUND_AHEAD=off`` waits first.

On CUDA each stage (draft, tree, verify, and the T=0 accept/commit) is captured as a CUDA graph
once per shape, before the prefill of the first request that needs it (a capture's warm-up runs
scribble on the caches); ``Stage.run`` replays it. A stage whose capture fails runs eagerly and
says so in ``Generation.extras["cuda_graph_errors"]``. Everywhere else the very same stage
functions run eagerly, which is what the CPU tests exercise. ``torch_compile`` (the
``fast-compile`` decode path) additionally compiles the decoder-layer halves and the tree build;
the CPU tests run that too. Before the captures, the Triton kernels of the request's new stages
are compiled in parallel (``ahead.compile_ahead``: the stages and the prefill run once on fake
tensors, each launch a compile in a worker process or a thread), so a cold Triton cache costs
about the slowest compile, not their sum. On CUDA the
engine stores the weights transposed at load (``layers.store_models_column_major``: cuBLAS reads
them faster at a verify's few rows), and the fused tensors here are stored so too.

T>0: rows are sampled with ``torch.multinomial`` in the eager path's order; on CPU the generator is
the eager path's, so a seed gives the same tokens; on CUDA it lives on the GPU (a different, equally
valid stream), and that sampling step runs outside the graphs.

A grammar (``request.constraint``) adds host work between the graphs, never inside them: after the
tree stage the host reads the tree (``_read_tree``: a second sync per round; the exact host build
right away when the device build could not prove its order); while the verify stage runs, it
computes each node's path mask with llguidance, marks the nodes the grammar forbids invalid, and
applies the masks (unpacked on the device) to the static logits buffer in place (``_constrain``),
so the captured choose/accept/commit stage sees masked logits. Unconstrained requests run none
of this.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddtree_diag.engine import gdn
from ddtree_diag.engine.decode import DecodeContext, DecodeRequest, Generation, GenerationRecorder, make_generator
from ddtree_diag.engine.fast import ahead, kernels
from ddtree_diag.engine.fast.graphs import (
    BLAS_LIBRARIES,
    BLAS_MARGIN,
    Stage,
    StageTimer,
    blas_plan,
    blas_switchable,
)
from ddtree_diag.engine.fast.layers import (
    FusedWeights,
    additive_mask,
    attend,
    column_major_weights,
    draft_context_kv,
    draft_pre_attention,
    linear_attention_rows,
    mlp_half,
    residual_norm,
    settle,
    target_post_attention,
    target_pre_attention,
)
from ddtree_diag.engine.fast.tree import (
    build_tree_kernel,
    build_tree_tensors,
    tree_node_count,
    write_tree_rows,
)
from ddtree_diag.engine.grammar import GrammarState
from ddtree_diag.engine.target import attend_with_sinks, prefill_chunks, prefill_in_chunks, sink_bias
from ddtree_diag.engine.tree import ancestor_mask, build_tree
from ddtree_diag.errors import UsageError
from ddtree_diag.output.reportfile import write_output

CACHE_ROUNDING = 512  # caches grow in these steps so graphs survive similar requests
# Attention reads only the first `window` cache slots, rounded up to this step: a round attends
# over about what is used (one graph per window) instead of the whole preallocated cache.
WINDOW = 256


def use_persistent_compile_cache() -> None:
    """Keep torch.compile's artifacts (inductor's FX-graph and kernel caches, keyed by the graphs'
    shapes) in the tool's cache directory unless the user chose one: the first request of a shape
    compiles once per machine, later processes load the compiled stages in seconds (measured on
    the CPU twin: 88 s cold, 6.5 s warm). /tmp, torch's default, is wiped with the container."""
    import os

    from ddtree_diag.engine.embedded import cache_root

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def _kernel_switches() -> list[tuple[str, str]]:
    """The environment switches that choose the fast path's kernels and weight layout (part of the
    keys other processes read: a compile-ahead marker, a stored BLAS choice)."""
    return sorted(
        (name, value) for name, value in os.environ.items()
        if name in ("DDTREE_DIAG_KERNELS", "DDTREE_DIAG_WEIGHT_LAYOUT", "DDTREE_DIAG_ATTENTION")
        or (name.startswith("DDTREE_DIAG_") and name.endswith("_KERNEL"))
    )


def _without_window(key: tuple) -> tuple:
    """A stage key with its attention window left out (the draft and verify stages end with it)."""
    return key[:-1] if key[0] in ("draft", "verify") else key


def _in_window(key_slots: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, keys] bool: the keys within a sliding window of ``size`` of each row. Keys at cache
    slots ``key_slots``: a committed slot's position is its index; the rows' own slots ``slots``
    hold their (tree) ``positions``."""
    key_pos = key_slots.clone()
    key_pos.index_copy_(0, slots, positions)
    return key_pos[None, :] > positions[:, None] - size


def attention_window(needed: int, max_len: int) -> int:
    """Cache slots a round attends over when its highest used slot is below ``needed``."""
    return min(max_len, -(-needed // WINDOW) * WINDOW)


class FastDecoder:
    """Runs the decode rounds the fast way; see the module docstring."""

    def __init__(
        self,
        context: DecodeContext,
        graphs: bool | None = None,
        torch_compile: bool = False,
        compile_backend: str | None = None,
    ) -> None:
        self.context = context
        self.target = context.target
        self.draft = context.draft
        self.device = context.device
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        self.max_len = 0
        self._cache_k: torch.Tensor | None = None  # the target cache our stages were built on
        self.stages: dict[tuple, Stage] = {}
        self._pool = None
        self.capturing = False
        self.capture_broken = False  # a failed capture: capture nothing more (see Stage)
        # Before a request's new stages first run (on CUDA: their capture), compile their Triton
        # kernels in parallel (``ahead.py``); torch.compile's own kernels are not Triton launches
        # of ours. DDTREE_DIAG_COMPILE_AHEAD=off: each kernel compiles at its first launch, as
        # before. The CPU tests switch it on to check the pass against the real rounds.
        self.compile_ahead = self.graphs and not torch_compile and not kernels.switched_off("DDTREE_DIAG_COMPILE_AHEAD")
        self.passed: set[tuple] = set()  # stage keys (less the window) a pass compiled: kept when stages clear
        # The BLAS library of the draft and verify stages' GEMMs (``graphs.Stage``): where they are
        # captured in bf16 / fp16, each stage shape (the draft; a verify's row count) is captured
        # under each library once and the faster replay decides for every window and feature
        # setting of that shape (neither changes a GEMM); fp32, the dtype the lossless checks
        # compare in, keeps torch's default, as the eager path runs. DDTREE_DIAG_BLAS fixes one
        # library for all.
        self.blas = blas_plan(self.target.dtype)
        if self.graphs and self.blas in BLAS_LIBRARIES and not blas_switchable():
            raise UsageError(f"DDTREE_DIAG_BLAS={self.blas}: this torch build cannot run its GEMMs through it")
        # stage shape (see _stage) -> {"chosen": library, each library's replay ms, or the "error"
        # of the one that would not capture; "stored": measured by an earlier process}
        self.blas_choices: dict[tuple, dict[str, Any]] = {}
        # torch_compile: torch.compile the two halves of a decoder layer (norms, rotary, SwiGLU
        # fused into a few kernels) and the tree build. One compiled graph per row count serves
        # every layer, since the layer is an input (inlined nn.Modules). The compiled kernels then
        # run inside the stage's CUDA graph. The prefill (its length varies) stays uncompiled.
        self.torch_compile = torch_compile
        # torch.compile's backend: inductor (generated kernels), unless DDTREE_DIAG_COMPILE_BACKEND
        # names another (aot_eager traces the same graphs without generating code: the CPU tests use
        # it, since inductor's C++ builds take a minute there on a cold cache).
        self.compile_backend = compile_backend or os.environ.get("DDTREE_DIAG_COMPILE_BACKEND") or "inductor"
        self._pre_attention, self._post_attention = target_pre_attention, target_post_attention
        self._draft_pre_attention = draft_pre_attention
        self._build_tree = None  # None: the module's build_tree_tensors, looked up per call
        if torch_compile:
            import torch._dynamo

            use_persistent_compile_cache()

            # one compiled graph per row count and model: AR, draft block, each budget's bucket, for
            # every model in the process; the default limit (8) sends the rest back to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            backend = self.compile_backend
            self._pre_attention = torch.compile(target_pre_attention, dynamic=False, backend=backend)
            self._post_attention = torch.compile(target_post_attention, dynamic=False, backend=backend)
            self._draft_pre_attention = torch.compile(draft_pre_attention, dynamic=False, backend=backend)
            self._build_tree = torch.compile(build_tree_tensors, dynamic=False, backend=backend)
        t = self.target
        self.rep = t.heads // t.kv_heads
        # stored transposed as the engine stores the other weights on CUDA (layers.column_major_weights)
        column_major = column_major_weights(self.device)
        self.fused = [FusedWeights.for_layer(layer, column_major) for layer in t.layers]
        if self.draft is not None:
            dc = self.draft.config
            self.draft_fused = [FusedWeights.for_layer(layer, column_major) for layer in self.draft.layers]
            self.block = dc.block_size
            self.feature_layers = list(dc.target_layer_ids)
            self.d_heads, self.d_kv_heads, self.d_head_dim = (
                dc.num_attention_heads, dc.num_key_value_heads, dc.dim_per_head,
            )
        else:
            self.block, self.feature_layers = 1, []

    # ---- buffers ------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """Static buffers for caches of ``capacity`` slots (rounded up); graphs die with them."""
        t, dev = self.target, self.device
        if capacity <= self.max_len and t.kv.k is self._cache_k:
            return
        if dev.type == "cuda":  # a round launched ahead at the end of the last request may still run
            torch.cuda.synchronize(dev)
        # a whole number of CACHE_ROUNDING slots (aligned attention masks), never less than allocated
        t.reset(-(-max(capacity, t.kv.capacity) // CACHE_ROUNDING) * CACHE_ROUNDING)
        self.max_len, self._cache_k = t.kv.capacity, t.kv.k
        self.stages.clear()
        if self.graphs:
            self._pool = torch.cuda.graph_pool_handle()
        long = dict(dtype=torch.long, device=dev)
        self.slot_index = torch.arange(self.max_len, **long)
        self.start = torch.zeros((), **long)  # committed target tokens = the root's slot
        self.root = torch.zeros(1, **long)
        self.depth_limit = torch.zeros((), **long)
        self.result: dict[int, torch.Tensor] = {}
        self.result_host: dict[int, torch.Tensor] = {}  # where it is copied to (pinned on CUDA)
        # the accept walk's output (``_commit``): the accepted row at each depth, how many, and the
        # target cache slots to move (from, to)
        self.accepted = {
            "keep": torch.zeros(self.block, **long), "count": torch.zeros(1, **long),
            "slots": torch.zeros(2 * self.block, **long),
        }
        if self.draft is not None:
            dc = self.draft.config
            shape = (dc.num_hidden_layers, 1, dc.num_key_value_heads, self.max_len, dc.dim_per_head)
            self.draft_k = torch.zeros(shape, device=dev, dtype=t.dtype)
            self.draft_v = torch.zeros(shape, device=dev, dtype=t.dtype)
            self.ctx_len = torch.zeros((), **long)  # context tokens in the draft cache
            self.pending = torch.zeros(self.block, len(self.feature_layers) * t.hidden_size, device=dev, dtype=t.dtype)
            self.pending_count = torch.zeros((), **long)
            self.mask_tail = torch.full((self.block - 1,), dc.mask_token_id, **long)
            self.logprobs = torch.zeros(self.block - 1, t.config.vocab_size, device=dev)
        self.trees: dict[int, dict[str, torch.Tensor]] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        # Hybrid targets: each Gated DeltaNet layer's committed recurrent state and conv window,
        # and per verify shape what the parallel solve leaves for commit (static buffers).
        # Where the layers are alike (every checkpoint so far), each layer's buffer is a slice of
        # one stack of all layers' (``committed_stack``, ``parts_stack``), so that the commit
        # moves every layer's state in one launch.
        self.linear_parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.parts_stack: dict[int, dict[str, torch.Tensor]] = {}
        self.committed_stack, committed = self._linear_buffers(0, {"state": torch.float32, "conv": t.dtype})
        self.linear_state = {index: buffers["state"] for index, buffers in committed.items()}
        self.linear_conv = {index: buffers["conv"] for index, buffers in committed.items()}

    def _linear_shapes(self, index: int, rows: int = 0) -> dict[str, tuple[int, ...]]:
        """A Gated DeltaNet layer's buffer shapes: its committed recurrent state and conv
        window, and for ``rows`` verify rows what the parallel solve keeps for the commit."""
        module = self.target.layers[index].linear_attn
        heads, dk, dv = module.num_v_heads, module.head_k_dim, module.head_v_dim
        channels = module.conv1d.weight.shape[0]
        return {
            "state": (heads, dk, dv), "conv": (channels, module.conv_kernel_size - 1), "keys": (heads, rows, dk),
            "updates": (heads, rows, dv), "path_decay": (heads, rows), "inputs": (rows, channels),
        }

    def _linear_buffers(
        self, rows: int, dtypes: dict[str, torch.dtype]
    ) -> tuple[dict[str, torch.Tensor] | None, dict[int, dict[str, torch.Tensor]]]:
        """Each Gated DeltaNet layer's zeroed buffers named in ``dtypes`` (shapes: ``_linear_shapes``
        for ``rows``), layer index -> name -> tensor; where the layers are alike, slices of one stack
        [layers, ...] per name, returned first (else None: each layer's are its own)."""
        layers = self.target.linear_layers
        shapes = [self._linear_shapes(index, rows) for index in layers]
        zeros = functools.partial(torch.zeros, device=self.device)
        if not layers or any(shape != shapes[0] for shape in shapes):
            return None, {
                index: {name: zeros(shape[name], dtype=dtype) for name, dtype in dtypes.items()}
                for index, shape in zip(layers, shapes, strict=True)
            }
        stack = {name: zeros((len(layers), *shapes[0][name]), dtype=dtype) for name, dtype in dtypes.items()}
        return stack, {index: {name: stack[name][position] for name in dtypes} for position, index in enumerate(layers)}

    def _tree_buffers(self, padded: int) -> dict[str, torch.Tensor]:
        if padded not in self.trees:
            long = dict(dtype=torch.long, device=self.device)
            self.trees[padded] = {
                "tokens": torch.zeros(padded, **long),
                "parents": torch.full((padded,), -1, **long),
                "depths": torch.zeros(padded, **long),
                "valid": torch.zeros(padded, dtype=torch.bool, device=self.device),
                "anc": torch.eye(padded, dtype=torch.bool, device=self.device),
                "exact": torch.ones((), dtype=torch.bool, device=self.device),
                "choice": torch.zeros(padded, **long),
            }
            t = self.target
            feats = len(self.feature_layers) * t.hidden_size
            self.outputs[padded] = {
                "logits": torch.zeros(padded, t.config.vocab_size, device=self.device, dtype=t.dtype),
                "features": torch.zeros(padded, max(feats, 1), device=self.device, dtype=t.dtype),
            }
            self.result[padded] = torch.zeros(3 + 2 * self.block, **long)
            self.result_host[padded] = torch.zeros(
                3 + 2 * self.block, dtype=torch.long, pin_memory=self.device.type == "cuda"
            )
            dtypes = {"keys": torch.float32, "updates": torch.float32, "path_decay": torch.float32, "inputs": t.dtype}
            stack, self.linear_parts[padded] = self._linear_buffers(padded, dtypes)
            if stack is not None:
                self.parts_stack[padded] = stack
        return self.trees[padded]

    def _stage(self, key: tuple, fn: Callable[[], None]) -> Stage:
        stage = self.stages.get(key)
        if stage is None:
            capture = self.graphs and self.capturing and not self.capture_broken
            # what the GEMMs' shapes follow: the draft's are fixed, a verify's are its row count
            shape = key[:1] if key[0] == "draft" else key[:2]
            blas, choose = None, False
            if self.graphs and key[0] in ("draft", "verify"):  # the stages with GEMMs
                if self.blas != "auto":
                    blas = self.blas
                else:
                    choice = self.blas_choices.get(shape) or self._stored_blas(shape)
                    blas, choose = (choice["chosen"], False) if choice else (None, capture)
            stage = self.stages[key] = Stage(fn, capture, self._pool, blas=blas, choose_blas=choose)
            self.capture_broken = self.capture_broken or stage.capture_failed
            if choose and stage.blas is not None:  # measured (or the alternative would not capture)
                error = {"error": stage.blas_error} if stage.blas_error else {}
                self.blas_choices[shape] = {"chosen": stage.blas, **stage.blas_ms, **error}
                # a choice made without the alternative (it would not capture, perhaps for a
                # moment's lack of memory) is this process's only; a measured one is kept, unless
                # another process kept one first: then every process runs that one
                kept = None if stage.blas_error else self._store_blas(shape)
                if kept is not None and kept["chosen"] != stage.blas and not self.capture_broken:
                    stage = self.stages[key] = Stage(fn, capture, self._pool, blas=kept["chosen"])
                    self.capture_broken = stage.capture_failed
        return stage

    def _blas_file(self, shape: tuple) -> Path | None:
        """Where this machine keeps a stage shape's measured BLAS choice (``DDTREE_DIAG_CACHE``):
        keyed by what the GEMMs and the libraries' kernels follow (the stage shape, the decode path
        and kernel switches, the models' configs and dtype, the reduced-precision and workspace
        settings, torch and CUDA versions, the GPU) and by the margin that decided. None where that
        cannot be read."""
        try:
            from ddtree_diag.engine.embedded import cache_root

            gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            matmul = torch.backends.cuda.matmul
            gemm_settings = (
                matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction,
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
            )
            key = repr((
                shape, self.torch_compile, _kernel_switches(), *self._models_and_gpu(), gemm_settings, gpu,
                torch.__version__, torch.version.cuda, BLAS_MARGIN,
            ))
        except Exception:  # no stored choice: the shape is measured in each process
            return None
        return cache_root() / "blas-choice" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def _stored_blas(self, shape: tuple) -> dict[str, Any] | None:
        """A choice an earlier process measured for ``shape`` on this machine, now this decoder's
        (it then stands: the same library in every process, so bf16 runs repeat), else None (also
        where this torch cannot switch libraries). Remove the cache's ``blas-choice`` folder to
        measure again."""
        path = self._blas_file(shape) if blas_switchable() else None
        try:
            stored = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("chosen") not in BLAS_LIBRARIES:
            return None
        self.blas_choices[shape] = stored | {"stored": True}
        return self.blas_choices[shape]

    def _store_blas(self, shape: tuple) -> dict[str, Any] | None:
        """Keep this process's measured choice for later ones, unless a process measuring the same
        shape at the same time kept its own first: that one is returned (and becomes this
        decoder's). None where nothing could be kept; a cache that cannot be written is no error."""
        path = self._blas_file(shape)
        if path is None:
            return None
        mine = self.blas_choices[shape]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(json.dumps(mine))
                os.link(temp, path)  # creates the file whole, and only where none is yet
            finally:
                os.unlink(temp)
            return mine
        except FileExistsError:
            kept = self._stored_blas(shape)  # None: a damaged file, replaced below
            if kept is not None:
                return kept
        except OSError:  # no hard links here (or no cache): replaced whole below, where it can be
            pass
        with contextlib.suppress(UsageError):
            write_output(path, json.dumps(mine))
            return mine
        return None

    # ---- target -------------------------------------------------------------------------------
    def _target_forward(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        anc: torch.Tensor,
        with_features: bool,
        window: int,
        compiled: bool = True,
        parents: torch.Tensor | None = None,
        last_only: bool = False,
        continued: bool = False,
        outputs: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``tokens`` at positions start+depth, K/V written at slots start.., attention over
        the cache slots [0, window): committed slots plus the rows' ancestors (``anc``).
        ``compiled=False`` (the prefill, whose length varies) never uses the compiled layer halves;
        ``last_only``: the last row's logits only (``TargetModel.head``).
        Gated DeltaNet layers (hybrid targets): ``parents`` None = the prompt, committed whole
        (chunked form, state written at once; ``continued``: from the committed state, a prompt's
        later chunk); else tree rows in one parallel solve whose parts wait in ``linear_parts``
        for commit. ``outputs``: the verify's static logits / features, written in place
        (``TargetModel.head``)."""
        t = self.target
        pre, post = (self._pre_attention, self._post_attention) if compiled else (
            target_pre_attention, target_post_attention,
        )
        rows = tokens.shape[0]
        positions = self.start + depths
        slots = self.start + self.slot_index[:rows]
        key_slots = self.slot_index[:window]
        mask = (key_slots < self.start).unsqueeze(0).expand(rows, window).clone()
        mask.index_copy_(1, slots, anc)
        # GQA without copying the cache: the query heads of one KV head become extra query rows.
        # The boolean mask becomes an additive bias once per window size (full attention: None)
        # rather than inside SDPA in every layer (built on first use: the verify/AR rows of
        # full-attention layers on CUDA go through the split-key kernel instead,
        # ``triton_attention``, which reads ``start`` and ``anc`` itself; the prefill never does).
        # Attention sinks (gpt-oss): the mask with one more key slot (``sink_bias``, once per window
        # size) and ``attend_with_sinks``, always through SDPA.
        allowed: dict[int | None, torch.Tensor] = {}
        biases: dict[int | None, torch.Tensor] = {}
        sink_biases: dict[int | None, torch.Tensor] = {}
        hidden = t.embed_input(tokens[None])
        ropes = t.layer_ropes(hidden, positions)
        # tree rows' root paths for the Gated DeltaNet solve kernel, once for all its layers
        paths = None
        if parents is not None and self.linear_state:
            module = t.layers[next(iter(self.linear_state))].linear_attn
            paths = kernels.gdn_path_table(anc, hidden, self.block, module)
        wanted = set(self.feature_layers) if with_features else set()
        features: dict[int, torch.Tensor] = {}
        # The last MLP's output, not yet added to ``hidden``: the next attention layer's input norm
        # adds it in its own kernel (``mlp_half``'s defer); anything else that reads the hidden
        # state adds it first. Also the q/k norm + rotary and K/V write as one kernel (``cache``).
        # Not in the compiled layer halves: torch.compile fuses those steps itself, and a first
        # layer without a residual would be one more graph per row count.
        residual = None
        fold = not (compiled and self.torch_compile)
        repeats = ahead.Repeats()  # a dry pass (ahead.py) runs one layer of each kind
        for index, layer in enumerate(t.layers):
            if repeats.skip(layer, residual is None, index in wanted, index == t.num_layers - 1, t.windows[index]):
                if index in wanted and index != t.num_layers - 1:  # the head still reads its features
                    hidden, residual = settle(hidden, residual), None
                    features[index] = hidden
                continue
            fused = self.fused[index]
            if index in self.linear_state:
                delta, hidden = self._linear_layer(index, layer, hidden, residual, parents, anc, paths, continued)
                hidden, residual = mlp_half(layer, hidden, fused, delta=delta, defer=True, arch=t.arch)
            else:
                slot = t.cache_slot[index]
                cache = (t.kv.k[slot], t.kv.v[slot], self.start) if fold else None
                q, k, v, gate, hidden = pre(
                    layer, hidden, *ropes[index], t.heads, t.kv_heads, t.head_dim, fused,
                    arch=t.arch, residual=residual, cache=cache,
                )
                if k is None:  # q/k norm, rotary and the K/V write ran as one kernel
                    cache_k, cache_v = cache[0], cache[1]
                else:
                    cache_k, cache_v = t.kv.write(slot, slots, k, v)
                size = t.windows[index]
                plain = not (t.arch.attention_sinks or t.arch.latent_attention)  # the split-key kernel's kind
                tree_rows = parents is not None and size is None and plain
                kernel = kernels.attention_kernel(q, cache_k) if tree_rows else None
                if kernel is not None:
                    scale = t.head_dim**-0.5 if t.scaling is None else t.scaling
                    out = kernel.tree_attention(q, cache_k, cache_v, anc, self.start, window, scale)
                else:
                    if size not in allowed:
                        in_window = mask if size is None else mask & _in_window(key_slots, slots, positions, size)
                        allowed[size] = in_window.repeat(self.rep, 1)[None, None]
                    q = q.reshape(1, t.kv_heads, self.rep * rows, t.head_dim)
                    keys, values = cache_k[:, :, :window], cache_v[:, :, :window]
                    if t.arch.attention_sinks:  # the query heads of a KV head are its row blocks
                        sinks = layer.self_attn.sinks.view(t.kv_heads, self.rep, 1).expand(-1, -1, rows)
                        sinks = sinks.reshape(1, t.kv_heads, self.rep * rows, 1)
                        if size not in sink_biases:
                            sink_biases[size] = sink_bias(allowed[size], t.dtype)
                        out = attend_with_sinks(q, keys, values, sink_biases[size], sinks, t.scaling)
                    else:
                        if size not in biases:
                            biases[size] = additive_mask(allowed[size], t.dtype)
                        out = attend(q, keys, values, biases[size], t.scaling)
                    out = out.reshape(1, t.heads, rows, t.v_head_dim).transpose(1, 2)
                    out = out.reshape(1, rows, t.heads * t.v_head_dim)
                hidden, residual = post(layer, hidden, out, fused, gate, True, t.arch) if fold else (
                    post(layer, hidden, out, fused, gate, arch=t.arch), None
                )
            if index in wanted and index != t.num_layers - 1:
                hidden, residual = settle(hidden, residual), None
                features[index] = hidden
        # the deferred residual add and the final norm in one kernel (HF's norm module runs six)
        _, hidden = residual_norm(t.inner.norm, hidden, residual)
        return t.head(
            hidden, features, self.feature_layers if with_features else None, last_only, normed=True, out=outputs
        )

    def _prefill(self, prompt: torch.Tensor, with_features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt's rows through the target at slots 0.. in ``prefill_chunks`` as the eager
        target runs them (causal; never the compiled layer halves, its length varies): (the last
        row's logits [1, V], the draft's context features [T, n*H] or None). Leaves ``start`` at
        the last chunk's first slot."""

        def chunk(begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            rows = end - begin
            causal = torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril()
            self.start.fill_(begin)
            return self._target_forward(
                prompt[begin:end], self.slot_index[:rows], causal, with_features, attention_window(end, self.max_len),
                compiled=False, last_only=True, continued=begin > 0,
            )

        return prefill_in_chunks(prompt.shape[0], self.device, chunk)

    def _linear_layer(
        self,
        index: int,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        parents: torch.Tensor | None,
        anc: torch.Tensor,
        paths: torch.Tensor | None = None,
        continued: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Gated DeltaNet layer's output [1, rows, H] and its input hidden state (``hidden`` +
        ``residual``, the add inside the input norm's kernel): the prompt (``parents`` None;
        committed at once; ``continued``: a later chunk, from the committed state) or tree rows
        (the parallel solve, kept for ``_commit``; ``paths``: the rows' path table for the solve
        kernel)."""
        hidden, x = residual_norm(layer.input_layernorm, hidden, residual)
        x = x[0]
        module = layer.linear_attn
        if parents is None:
            if ahead.dry():  # the prompt's recurrence launches no Triton kernel: a pass needs its shape only
                return x.new_empty(1, x.shape[0], module.out_proj.out_features), hidden
            committed = (self.linear_state[index], self.linear_conv[index]) if continued else (None, None)
            out, state, conv = gdn.gdn_layer_prefill(module, x, *committed)
            self.linear_state[index].copy_(state)
            self.linear_conv[index].copy_(conv)
            return out[None], hidden
        kept = self.linear_parts[x.shape[0]][index]
        out, parts, inputs = linear_attention_rows(
            module, x, parents, anc, self.linear_state[index], self.linear_conv[index], self.fused[index], kept,
            max_path=self.block, paths=paths,  # root + at most block - 1 drafted depths
        )
        written = (("keys", parts.keys), ("updates", parts.updates), ("path_decay", parts.path_decay))
        for name, value in (*written, ("inputs", inputs)):
            if value is not kept[name]:  # the Gated DeltaNet kernels wrote them in place already
                kept[name].copy_(value)
        return out[None], hidden

    def _verify(self, padded: int, with_features: bool, window: int) -> None:
        tree, out = self.trees[padded], self.outputs[padded]
        self._target_forward(
            tree["tokens"], tree["depths"], tree["anc"], with_features, window, parents=tree["parents"], outputs=out
        )

    # ---- draft --------------------------------------------------------------------------------
    def _write_context(self, features: torch.Tensor, first_slot: torch.Tensor | int) -> torch.Tensor:
        """Put context features' K/V in the draft cache at slots first_slot.. (positions = slots)."""
        d = self.draft
        count = features.shape[0]
        slots = first_slot + self.slot_index[:count]
        ctx = kernels.rms_norm(d.hidden_norm, d.fc(features[None].to(self.target.dtype)))
        rope = d.rope(slots, 1, ctx.dtype)
        repeats = ahead.Repeats()
        for index, layer in enumerate(d.layers):
            if repeats.skip(layer):
                continue
            k, v = draft_context_kv(layer.self_attn, ctx, *rope)
            self.draft_k[index].index_copy_(2, slots, k)
            self.draft_v[index].index_copy_(2, slots, v)
        return slots

    def _draft(self, window: int) -> None:
        """Pending context into the draft cache, then the noise block → per-depth log-probs.
        Attends over the draft cache slots [0, window)."""
        d, block = self.draft, self.block
        ctx_slots = self._write_context(self.pending, self.ctx_len)
        noise_slots = ctx_slots + block  # scratch region after the (padded) context
        key_slots = self.slot_index[:window]
        visible = (key_slots < self.ctx_len + self.pending_count) | (
            (key_slots >= noise_slots[0]) & (key_slots < noise_slots[0] + block)
        )
        rep = self.d_heads // self.d_kv_heads
        # Each layer's mask by block row: [1, window] shared by the rows (full attention), or a
        # sliding layer's band [block, window]. The split-key kernel (``triton_attention``'s masked
        # mode) reads these as they are; SDPA's forms (GQA rows: the band repeated per query head
        # of a KV head) are made at their first use, so the kernel path builds none of them.
        masks: dict[int | None, torch.Tensor] = {None: visible[None, :]}
        for size in {d.config.layer_window(i) for i in range(len(d.layers))} - {None}:
            # context slots hold positions equal to their slot; the noise block sits at start..
            offset = key_slots - noise_slots[0]
            is_noise = (offset >= 0) & (offset < block)
            key_positions = torch.where(is_noise, self.start + offset, key_slots)
            query_positions = self.start + self.slot_index[:block]
            near = key_positions[None, :] > query_positions[:, None] - size
            masks[size] = visible[None, :] & near
        sdpa_masks: dict[int | None, torch.Tensor] = {}
        noise_ids = torch.cat([self.root, self.mask_tail])
        hidden = self.target.embed(noise_ids[None])
        rope = d.rope(self.start + self.slot_index[:block], 1, hidden.dtype)
        heads, kv_heads, head_dim = self.d_heads, self.d_kv_heads, self.d_head_dim
        # as in _target_forward, outside the compiled halves: the residual after each MLP added by
        # the next norm's kernel, and one kernel for q/k norm + rotary and the K/V write
        residual = None
        repeats = ahead.Repeats()
        for index, layer in enumerate(d.layers):
            if repeats.skip(layer, residual is None, d.config.layer_window(index)):
                continue
            fused = self.draft_fused[index]
            cache = None if self.torch_compile else (self.draft_k[index], self.draft_v[index], noise_slots[0])
            q, k, v, hidden = self._draft_pre_attention(layer, hidden, *rope, heads, head_dim, fused, cache, residual)
            if k is not None:
                self.draft_k[index].index_copy_(2, noise_slots, k)
                self.draft_v[index].index_copy_(2, noise_slots, v)
            size = d.config.layer_window(index)
            kernel = kernels.attention_kernel(q, self.draft_k[index])
            if kernel is not None:  # output already [1, block, heads * head_dim], o_proj's layout
                scale = head_dim**-0.5  # SDPA's default: the fallback below and the eager draft use it
                out = kernel.masked_attention(q, self.draft_k[index], self.draft_v[index], masks[size], window, scale)
            else:
                if size not in sdpa_masks:
                    sdpa_masks[size] = (
                        visible[None, None, None, :] if size is None
                        else masks[size].repeat(rep, 1)[None, None]  # rows: (head group, block)
                    )
                q = q.reshape(1, kv_heads, (heads // kv_heads) * block, head_dim)
                cache_k, cache_v = self.draft_k[index][:, :, :window], self.draft_v[index][:, :, :window]
                out = attend(q, cache_k, cache_v, sdpa_masks[size])
                out = out.reshape(1, heads, block, head_dim).transpose(1, 2).reshape(1, block, heads * head_dim)
            if self.torch_compile:
                hidden = self._post_attention(layer, hidden, out, fused)
            else:
                hidden, residual = self._post_attention(layer, hidden, out, fused, None, True)
        hidden = residual_norm(d.norm, hidden, residual)[1]
        logits = self.target.lm_head(hidden[0, 1:])
        torch.log_softmax(logits.float(), dim=-1, out=self.logprobs)  # the same kernel, no copy after

    # ---- tree ---------------------------------------------------------------------------------
    def _tree(self, padded: int, budget: int, mode: str) -> None:
        tree = self._tree_buffers(padded)
        exact = torch.ones((), dtype=torch.bool, device=self.device)
        tree_kernel = kernels.tree_kernel(self.device)
        if mode == "chain":
            depth_rows = torch.arange(1, self.block, device=self.device)
            tokens, parents, depths = kernels.argmax(self.logprobs), depth_rows - 1, depth_rows
            valid = depth_rows <= self.depth_limit
        else:
            # one Triton program running the heap (exact: ``exact`` is always True) where the
            # kernels run, else the tensor build (~300 small kernels, proven or sent to the host)
            builder = self._build_tree or build_tree_tensors
            if tree_kernel is not None:
                builder = build_tree_kernel
            built = builder(self.logprobs, budget, self.depth_limit)
            tokens, parents, depths, valid = built["tokens"], built["parents"], built["depths"], built["valid"]
            exact = built["exact"]
        tree["exact"].copy_(exact)
        # one launch where the kernels run (not ~35 small kernels), else the same rows in torch ops
        write = tree_kernel.write_tree_rows if tree_kernel is not None else write_tree_rows
        write(tree, self.root, tokens, parents, depths, valid, self.block - 1)

    def _host_tree(self, padded: int, budget: int, depth: int, root: int) -> None:
        """Exact fallback: ``tree.build_tree`` on the host, written into the static buffers."""
        built = build_tree(root, self.logprobs[:depth].cpu(), budget)
        tree = self.trees[padded]
        n = len(built.tokens)
        long = dict(dtype=torch.long)
        tokens = torch.zeros(padded, **long)
        parents = torch.full((padded,), -1, **long)
        depths = torch.zeros(padded, **long)
        tokens[:n], parents[:n], depths[:n] = (
            torch.tensor(built.tokens),
            torch.tensor(built.parents),
            torch.tensor(built.depths),
        )
        anc = torch.eye(padded, dtype=torch.bool)
        anc[:n, :n] = ancestor_mask(built.parents)
        valid = torch.arange(padded) < n
        for name, value in (
            ("tokens", tokens),
            ("parents", parents),
            ("depths", depths),
            ("anc", anc),
            ("valid", valid),
        ):
            tree[name].copy_(value)
        tree["exact"].fill_(True)

    # ---- accept + commit ----------------------------------------------------------------------
    def _commit(self, padded: int) -> None:
        """Accept walk on ``choice`` (the target's token per row), compact the target cache, queue
        the kept rows' features for the draft, advance; all guarded by the tree's ``exact``."""
        tree, out = self.trees[padded], self.outputs[padded]
        block, ok, parents = self.block, tree["exact"], tree["parents"]
        keep, count, slots = self.accepted["keep"], self.accepted["count"], self.accepted["slots"]
        with_context = self.draft is not None and bool(self.feature_layers)
        walk = kernels.accept_kernel(tree["tokens"])
        if walk is not None:  # the walk and the round's counters in one kernel
            walk.accept(
                tree["tokens"], tree["choice"], parents, tree["valid"], tree["depths"], ok, self.start, self.root,
                self.ctx_len if with_context else None, self.pending_count if with_context else None,
                keep, count, slots, self.result[padded],
            )
        else:
            self._accept_walk(padded, with_context)
        # not ok: every row stays where it is (the round is redone with the host tree)
        self.target.kv.move(slots[:block], slots[block:])
        if with_context:
            self.pending.copy_(torch.where(ok, out["features"][keep], self.pending))
        if self.linear_state:
            # one decision for every layer: their states share a device and dtype (fp32)
            state_kernels = kernels.gdn_state_kernels(next(iter(self.linear_state.values())))
            stack = self.parts_stack.get(padded)  # there where the committed state is stacked too
            if state_kernels is not None and stack is not None:
                # every layer's state and conv window after the path's last row, one kernel
                committed = self.committed_stack
                state_kernels.commit_states(
                    committed["state"], committed["conv"], stack["keys"], stack["updates"], stack["path_decay"],
                    stack["inputs"], parents, keep, count, ok,
                )
                return
            last = keep.gather(0, count - 1)  # the deepest accepted row
            repeats = ahead.Repeats()
            for index, state in self.linear_state.items():
                if repeats.skip(self.target.layers[index]):
                    continue
                kept = self.linear_parts[padded][index]
                if state_kernels is not None:  # the state and conv window after `last`, one kernel
                    state_kernels.commit_states(
                        state, self.linear_conv[index], kept["keys"], kept["updates"], kept["path_decay"],
                        kept["inputs"], parents, keep, count, ok,
                    )
                    continue
                parts = gdn.ParallelParts(kept["keys"], kept["updates"], kept["path_decay"], tree["anc"], state)
                new_state = gdn.state_after(parts, last)
                new_conv = gdn.conv_tail(kept["inputs"], parents, self.linear_conv[index], last)
                state.copy_(torch.where(ok, new_state, state))
                self.linear_conv[index].copy_(torch.where(ok, new_conv, self.linear_conv[index]))

    def _accept_walk(self, padded: int, with_context: bool) -> None:
        """The accept walk in PyTorch ops, as ``triton_accept`` does it in one kernel: ``accepted``'s
        keep / count / slots, the host's result row, and (only where the tree is exact) the
        committed count, root and draft context counters advanced."""
        tree, block = self.trees[padded], self.block
        choice, tokens, parents, depths = tree["choice"], tree["tokens"], tree["parents"], tree["depths"]
        ok = tree["exact"]
        rows = torch.arange(padded, device=self.device)
        compat = (tokens == choice[parents.clamp(min=0)]) & tree["valid"]
        compat = compat | (rows == 0)
        accepted = ~(tree["anc"] & ~compat[None, :]).any(dim=-1)
        keep_all = torch.zeros(block + 1, dtype=torch.long, device=self.device)
        keep_all.scatter_(0, torch.where(accepted, depths, block), rows)  # row at its depth; rest to a dump slot
        keep = self.accepted["keep"].copy_(keep_all[:block])
        count = accepted.sum()
        self.accepted["count"].copy_(count.reshape(1))
        bonus = choice[keep.gather(0, (count - 1)[None])]
        in_order = self.slot_index[:block]
        self.accepted["slots"].copy_(self.start + torch.cat([torch.where(ok, keep, in_order), in_order]))
        if with_context:
            self.ctx_len.add_(torch.where(ok, self.pending_count, 0))
            self.pending_count.copy_(torch.where(ok, count, self.pending_count))
        self.start.add_(torch.where(ok, count, 0))
        self.root.copy_(torch.where(ok, bonus, self.root))
        self.result[padded].copy_(torch.cat([ok.long()[None], count[None], bonus, keep, tokens[keep]]))

    def _choose(
        self, padded: int, rows: int | torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> None:
        """The target's token per row: argmax, or a draw for the first ``rows`` rows (or the rows a
        tensor of indices names: the nodes a grammar left; the others are never accepted)."""
        logits = self.outputs[padded]["logits"]
        choice = self.trees[padded]["choice"]
        if temperature <= 0:
            kernels.argmax(logits, out=choice)
            return
        index = slice(0, rows) if isinstance(rows, int) else rows
        probs = torch.softmax(logits[index].float() / temperature, dim=-1)
        choice[index] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    # ---- the loop -----------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, request: DecodeRequest) -> Generation:
        t = self.target
        mode, budget, temperature = request.mode, request.tree_budget, request.temperature
        cuda = self.device.type == "cuda"
        prompt_len = len(request.prompt_ids)
        vocab = t.config.vocab_size
        # One verify shape for the whole request (the tree's node count only shrinks, by the depth
        # limit, in the last rounds; those rows are padding) plus the 1-row shape of a last round.
        # Not rounded up to a multiple of 16: on an H200 the 27B budget-256 round takes 32.3 ms at
        # 257 rows against 32.9 at 272 (cuBLAS's GEMMs are no slower at 257, the tree kernels do
        # less).
        if mode == "tree":
            padded = budget + 1
        elif mode == "chain":
            padded = self.block
        else:
            padded = 1
        reach = max(padded, 2 * self.block) + 1  # a round uses cache slots below start + reach
        self._allocate(prompt_len + request.max_tokens + reach + 1)
        # On CUDA the generator lives on the GPU (a different, equally valid stream than the eager
        # path's CPU generator); on CPU it is the same, so a seed gives the same tokens.
        generator = make_generator(temperature, request.seed, self.device)
        with_features = mode != "ar"
        # Create (on CUDA: capture) this request's stages before the prefill: a capture's warm-up
        # runs scribble on the caches and counters, which the prefill then resets.
        for value in (self.start, self.root, *((self.ctx_len, self.pending_count) if self.draft else ())):
            value.zero_()
        # One set per attention window the request can reach (the window grows with the context).
        self.capturing = True
        first_window = attention_window(prompt_len + reach, self.max_len)
        last_window = attention_window(prompt_len + request.max_tokens + reach, self.max_len)
        windows = range(first_window, last_window + 1, WINDOW)
        steady_plans = {w: self._stage_plans(padded, budget, mode, temperature, with_features, w) for w in windows}
        last_plans = {w: self._stage_plans(1, budget, "ar", temperature, with_features, w) for w in windows}
        ahead_report = None
        if self.compile_ahead:
            ahead_report = self._compile_ahead(
                [*steady_plans.values(), *last_plans.values()], padded, temperature, prompt_len, with_features
            )
        steady = {w: self._stages_from(plans) for w, plans in steady_plans.items()}
        last = {w: self._stages_from(plans) for w, plans in last_plans.items()}
        self.capturing = False

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        record = GenerationRecorder(request, self.context.decode_text, incremental=not self.context.harmony)
        grammar = None
        if request.constraint is not None:
            grammar = GrammarState(request.constraint, request.stop_ids, vocab)
        prompt = torch.tensor(request.prompt_ids, device=self.device)
        t.kv.reset()
        self.start.zero_()
        logits, features = self._prefill(prompt, with_features)
        self.start.fill_(prompt_len)
        t.kv.advance(prompt_len)
        last_logits = logits[-1:].float()
        if grammar is not None:
            grammar.tree([0], [-1])  # the mask at the start of the output
            grammar.apply(last_logits)
        if temperature <= 0:
            first = int(last_logits.argmax(dim=-1))
        else:
            probs = torch.softmax(last_logits / temperature, dim=-1)
            first = int(torch.multinomial(probs, 1, generator=generator))
        complete = grammar.advance([first])[1] if grammar is not None else False
        if with_features:
            self.ctx_len.zero_()
            self._write_context(features, 0)
            self.ctx_len.fill_(prompt_len)
            self.pending_count.zero_()
        self.root.fill_(first)
        sync()
        record.first_token(first, last_logits[0], complete)

        fallbacks = 0
        # Round ahead: while the host reads a round's result and does its bookkeeping (stop strings,
        # streaming text, the stage timer), the GPU already runs the next round's first stages,
        # which need nothing from the host: the draft, or for AR the whole forward. Only where the
        # next round's shape is known before the read (see _round_ahead); not with a grammar (the
        # host acts between the stages). ``ahead``: the launched round's timer and stage names.
        round_ahead = grammar is None and not kernels.switched_off("DDTREE_DIAG_ROUND_AHEAD")
        ahead: tuple[StageTimer, tuple[str, ...]] | None = None
        while not record.done:
            depth = min(self.block - 1, record.remaining - 1) if mode != "ar" else 0
            window = attention_window(t.length + reach, self.max_len)
            if depth <= 0:
                nodes, stages, rows = 0, last[window], 1
            else:
                nodes = depth if mode == "chain" else tree_node_count(budget, depth, vocab)
                stages, rows = steady[window], padded
            if ahead is None:
                timer, launched = StageTimer(cuda), ()
                timer.start()
            else:
                (timer, launched), ahead = ahead, None
            if "draft" not in launched:
                if "draft" in stages:
                    self.depth_limit.fill_(depth)
                    stages["draft"].run()
                timer.mark("draft")
            if "tree" not in launched:
                stages["tree"].run()
                if grammar is not None:
                    tree_tokens, tree_parents, fell_back = self._read_tree(rows, nodes, budget, depth)
                    fallbacks += fell_back
                timer.mark("tree")
            verified, sampled = nodes, nodes + 1
            if "verify" not in launched:
                stages["verify"].run()  # on a GPU, the masks below are computed while it runs
                if grammar is not None:
                    verified, sampled = self._constrain(grammar, rows, tree_tokens, tree_parents)
                timer.mark("verify")
            state = generator.get_state() if generator is not None else None
            self._finish(stages, rows, sampled, temperature, generator)
            timer.mark("commit")
            read = self._start_read(rows)
            ar_logits = None
            if round_ahead:
                if mode == "ar" and request.top_logprobs > 0:
                    # the next forward, launched ahead, writes these logits again: the row the host
                    # keeps for top log-probs is copied first (on the device, in stream order)
                    ar_logits = self.outputs[rows]["logits"][:1].clone()
                ahead = self._round_ahead(steady if depth > 0 else last, mode, depth, record.remaining, reach)
            result = read()  # the round's one host sync
            if not result[0]:  # the vectorised tree could not prove its order: redo this round exactly
                # (the round launched ahead ran from the state before this round, which the
                # unaccepted round left as it was: it is run again once this one is redone)
                ahead = None
                fallbacks += 1
                self._host_tree(rows, budget, depth, int(self.root.item()))
                stages["verify"].run()
                if state is not None:
                    generator.set_state(state)
                self._finish(stages, rows, nodes + 1, temperature, generator)
                result = self.result[rows].tolist()
                assert result[0], "the exact host tree must be accepted"
            count, bonus = result[1], result[2]
            new_tokens = [*result[3 + self.block + 1 : 3 + self.block + count], bonus]
            t.kv.advance(count)
            logits_kept = ar_logits
            if request.top_logprobs > 0 and logits_kept is None:  # indexed on the device: no host copy
                logits_kept = self.outputs[rows]["logits"].index_select(0, self.result[rows][3 : 3 + count])
            complete = False
            if grammar is not None:
                kept, complete = grammar.advance(new_tokens)
                new_tokens = new_tokens[:kept]
            record.round(new_tokens, verified, logits_kept, complete)
            for stage, seconds in timer.elapsed():
                record.add_stage_time(stage, seconds)

        generation = record.result(extras={
            "fast": True,
            # norms, q/k norm + rotary and SwiGLU as fused Triton kernels (else torch ops; on the
            # fast-compile path, wherever torch.compile's own fusion does not run)
            "fused_kernels": kernels.active(self.device, self.target.dtype),
            "cuda_graphs": sorted("-".join(map(str, k)) for k, v in self.stages.items() if v.graph is not None),
            "cuda_graph_errors": sorted({v.error for v in self.stages.values() if v.error}),
            # per draft / verify stage shape measured so far: the BLAS library kept, and each one's
            # best replay in ms (graphs.Stage), or the error of the alternative that would not capture
            "blas_choices": {
                "-".join(map(str, shape)): choice for shape, choice in sorted(self.blas_choices.items(), key=repr)
            },
            "fast_tree_fallbacks": fallbacks,
            # what compiling this request's new Triton kernels ahead took (a pass ran: see ahead.py)
            **({"compile_ahead": ahead_report} if ahead_report is not None else {}),
            **(grammar.extras() if grammar is not None else {}),
        })
        if ahead is not None and cuda:
            # the request ended (a stop) with a round launched for nothing: it finishes here, after
            # this request's timings were taken, not inside the next request's first token
            torch.cuda.synchronize(self.device)
        return generation

    def _start_read(self, padded: int) -> Callable[[], list[int]]:
        """Start copying the round's result row to the host; the call returned waits for it and
        reads it. On CUDA the copy is queued behind the round, so the host can queue more first."""
        result, host = self.result[padded], self.result_host[padded]
        if self.device.type != "cuda":
            return result.tolist
        host.copy_(result, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list[int]:
            copied.synchronize()
            return host.tolist()

        return read

    def _round_ahead(
        self,
        stage_sets: dict[int, dict[str, Stage]],
        mode: str,
        depth: int,
        remaining: int,
        reach: int,
    ) -> tuple[StageTimer, tuple[str, ...]] | None:
        """Launch the next round's first stages before this round's result is read, when nothing
        in them can depend on it: the round's shape (its depth limit and attention window) is the
        same whatever this round commits, and they read only device state the commit leaves. That
        is the draft of a tree / chain round (the next round's depth stays ``block - 1``), or the
        tree and verify of an AR round (whose logits row, where top log-probs are asked, the caller
        copies first). ``stage_sets``: the request's stages per window for the next round's row
        count. Returns the launched round's timer and stage names, or None (nothing launched).

        If the request ends with this round (a stop token), the launched stages ran for nothing;
        they leave nothing the next request reads (it resets every counter and rewrites the caches
        it uses), and ``decode`` waits for them after taking the request's timings, so that they
        do not show in the next request's first token."""
        most = depth + 1  # tokens this round can commit: the root's path through the tree + bonus
        if mode == "ar":
            if remaining - most < 1:
                return None
            names = ("draft", "tree", "verify")
        elif depth <= 0 or remaining - most < self.block:
            return None
        else:
            names = ("draft",)
        length = self.target.length
        windows = {attention_window(length + committed + reach, self.max_len) for committed in (1, most)}
        if len(windows) > 1 or (stages := stage_sets.get(windows.pop())) is None:
            return None
        timer = StageTimer(self.device.type == "cuda")
        timer.start()
        if "draft" in stages:  # the depth limit stays: the next round has this round's depth
            stages["draft"].run()
        timer.mark("draft")
        if "verify" in names:
            stages["tree"].run()
            timer.mark("tree")
            stages["verify"].run()
            timer.mark("verify")
        return timer, names

    def _read_tree(self, padded: int, nodes: int, budget: int, depth: int) -> tuple[list[int], list[int], bool]:
        """A constrained round's tree on the host: (tokens, parents) of its real rows (a prefix),
        rebuilt exactly on the host first when the device build could not prove its order (the
        round is then never redone: its masks are for this tree). Also whether that happened."""
        tree, rows = self.trees[padded], nodes + 1

        def read() -> list[int]:
            return torch.cat([tree["exact"].long()[None], tree["tokens"][:rows], tree["parents"][:rows]]).tolist()

        values = read()
        fell_back = not values[0]
        if fell_back:
            self._host_tree(padded, budget, depth, values[1])
            values = read()
        return values[1 : 1 + rows], values[1 + rows :], fell_back

    def _constrain(
        self, grammar: GrammarState, padded: int, tokens: list[int], parents: list[int]
    ) -> tuple[int, int | torch.Tensor]:
        """Each node's path mask (llguidance, on the host), applied in place to the verify logits
        (the choose/commit stage reads that buffer); the nodes the grammar forbids leave ``valid``.
        Returns (nodes left, the rows a T>0 draw covers: those the eager loop verifies, in order)."""
        rows = len(tokens)
        allowed = grammar.tree(tokens, parents)
        sampled: int | torch.Tensor = rows
        if not all(allowed):
            self.trees[padded]["valid"][:rows] = torch.tensor(allowed, device=self.device)
            sampled = torch.tensor([i for i, ok in enumerate(allowed) if ok], device=self.device)
        grammar.apply(self.outputs[padded]["logits"][:rows])
        return sum(allowed) - 1, sampled

    def _finish(
        self, stages: dict[str, Stage], padded: int, rows: int | torch.Tensor, temperature: float, generator
    ) -> None:
        if "commit" in stages:  # T=0: argmax + accept + commit captured together
            stages["commit"].run()
        else:
            self._choose(padded, rows, temperature, generator)
            self._commit(padded)

    def _stage_plans(
        self, padded: int, budget: int, mode: str, temperature: float, with_features: bool, window: int
    ) -> dict[str, tuple[tuple, Callable[[], None]]]:
        """The stages of one round shape and attention window: name -> (key, function)."""
        self._tree_buffers(padded)
        plans: dict[str, tuple[tuple, Callable[[], None]]] = {}
        if mode != "ar":
            plans["draft"] = (("draft", window), lambda: self._draft(window))
        if mode == "ar":
            plans["tree"] = (("tree-ar", padded), lambda: self._ar_tree(padded))
        else:
            plans["tree"] = (("tree", mode, budget, padded), lambda: self._tree(padded, budget, mode))
        plans["verify"] = (
            ("verify", padded, with_features, window), lambda: self._verify(padded, with_features, window)
        )
        if temperature <= 0:

            def commit() -> None:
                self._choose(padded, padded, 0.0, None)
                self._commit(padded)

            plans["commit"] = (("commit", padded), commit)
        return plans

    def _stages_from(self, plans: dict[str, tuple[tuple, Callable[[], None]]]) -> dict[str, Stage]:
        """The stages of ``plans`` (created, and captured on CUDA, on first use)."""
        return {name: self._stage(key, fn) for name, (key, fn) in plans.items()}

    def _compile_ahead(
        self,
        plans: list[dict[str, tuple[tuple, Callable[[], None]]]],
        padded: int,
        temperature: float,
        prompt_len: int,
        with_features: bool,
    ) -> dict | None:
        """Compile the Triton kernels of the stages this request creates, in parallel, before any of
        them runs (``ahead.compile_ahead``: a cold Triton cache's first request). One window per
        stage suffices (the window changes no kernel's specialization), and a stage kind passed
        once, in any window, is not passed again; plus the prefill and, at T>0, the commits of a
        full and a last round (both run outside the stages). Returns the pass's report, None where
        none ran."""
        fresh: dict[tuple, Callable[[], None]] = {}
        for stage_plans in plans:
            for key, fn in stage_plans.values():
                windowless = _without_window(key)
                if key not in self.stages and windowless not in self.passed:
                    fresh.setdefault(windowless, fn)
        if not fresh or not kernels.active(self.device, self.target.dtype):
            return None
        fns = list(fresh.values())
        if temperature > 0:
            fns += [lambda rows=rows: self._commit(rows) for rows in sorted({padded, 1})]

        def prefill() -> None:
            prompt = torch.zeros(prompt_len, dtype=torch.long, device=self.device)
            _logits, features = self._prefill(prompt, with_features)
            if with_features:
                self._write_context(features, 0)

        touched = [obj for obj in (self, self.target, self.target.kv, self.draft) if obj is not None]
        identity = self._ahead_identity(fresh, temperature, prompt_len)
        report = ahead.compile_ahead([prefill, *fns], keep=touched, identity=identity)
        if report.error is None:
            self.passed.update(fresh)
        return report.as_dict()

    def _ahead_identity(
        self, fresh: dict[tuple, Callable[[], None]], temperature: float, prompt_len: int
    ) -> str | None:
        """What the kernels of a compile-ahead pass follow (its marker's key, with ahead.py's
        parts): the stages, the length class of the prompt's prefill chunks (a multiple of 16 or
        not, one row), the kernel switches, the model's shapes and dtype, the GPU. None where it
        cannot be told."""
        chunk_rows = [end - begin for begin, end in prefill_chunks(prompt_len, self.device)]
        try:
            return repr((
                sorted(map(repr, fresh)), temperature > 0,
                sorted({(rows % 16 == 0, rows == 1) for rows in chunk_rows}),
                _kernel_switches(),
                *self._models_and_gpu(),
            ))
        except Exception:  # no marker: the pass runs every time
            return None

    def _models_and_gpu(self) -> tuple:
        """What this process's kernels and their measured choices follow, for keys that other
        processes read (a compile-ahead marker, a stored BLAS choice): the target's dtype and
        config, the draft's config, the GPU's capability."""
        config = self.target.config.to_dict()
        config.pop("_name_or_path", None)  # the same model copied elsewhere has the same kernels
        return (
            str(self.target.dtype), json.dumps(config, sort_keys=True, default=repr),
            repr(getattr(self.draft, "config", None)),
            torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None,
        )

    def _ar_tree(self, padded: int) -> None:
        """Root only (an AR step, or the last round when no draft node could be committed)."""
        tree = self.trees[padded]
        rows = torch.arange(padded, device=self.device)
        tree["tokens"].copy_(torch.where(rows == 0, self.root, 0))
        tree["parents"].fill_(-1)
        tree["depths"].zero_()
        tree["valid"].copy_(rows == 0)
        tree["anc"].copy_(rows[:, None] == rows[None, :])
        tree["exact"].fill_(True)
