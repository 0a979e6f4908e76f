"""The fast path's elementwise steps, fused where Triton can run them.

A decode round on a GPU is many small kernels per layer: an HF RMSNorm alone is seven (cast,
square, mean, add, rsqrt, multiply, cast, scale), the q/k norms and rotary two dozen more. Inside
a CUDA graph they no longer cost launches, but each still costs a trip through memory and a few
microseconds. ``torch.compile`` fuses them, at tens of seconds of compiling on a cold cache; these
functions instead call three hand-written Triton kernels (``triton_kernels``) that compile in
about a second each, and fall back to the modules themselves everywhere else.

When they run (``DDTREE_DIAG_KERNELS``): ``auto`` (default) on CUDA tensors when Triton imports
and not while ``torch.compile`` traces (it fuses these itself); ``on`` also on CPU tensors (the
tests do that under Triton's interpreter, ``TRITON_INTERPRET=1``); ``off`` never.

The draft tree build (``triton_tree``, one program running the heap) follows the same setting;
``DDTREE_DIAG_TREE_KERNEL=off`` turns off that one alone (the tensor build then runs: for
before/after measurements).

So does the verify rounds' attention (``triton_attention``: the keys split across thread blocks,
flash-decoding style, where SDPA's memory-efficient kernel runs 16 blocks);
``DDTREE_DIAG_ATTENTION_KERNEL=off`` turns off that one alone (SDPA with the additive mask runs).

So do a hybrid target's Gated DeltaNet layers: the tree solve (``triton_gdn``: one or two kernels per
layer where ``gdn.parallel_gated_delta`` runs about forty), the tree rows' conv and the state
commit (``triton_gdn_state``); ``DDTREE_DIAG_GDN_KERNEL=off`` turns off those alone.

So does the target's q/k norm + rotary with the K/V cache write (``norm_rope_cache``: one kernel
per attention layer where two ``norm_rope`` calls and two ``index_copy_`` ran);
``DDTREE_DIAG_QKV_KERNEL=off`` turns off that one alone.

So does the tree build's per-depth top-k up to k = 64 (``triton_topk``: two launches at k = 16 on
a 152k vocabulary, where ``tree.ranked_top_k``'s key build and ``torch.topk`` run about eight kernels);
``DDTREE_DIAG_TOPK_KERNEL=off`` turns off that one alone. On CPU tensors it runs only with
``DDTREE_DIAG_TOPK_KERNEL=on`` besides ``DDTREE_DIAG_KERNELS=on``: under Triton's interpreter it
takes seconds per call at the tree tests' shapes, which would slow every other kernel test.

So does the greedy choice of a verify round (``argmax``: ``triton_argmax``, chunks of a row on
many thread blocks, then a merge per row, where PyTorch's reduce runs one block per row);
``DDTREE_DIAG_ARGMAX_KERNEL=off`` turns off that one alone.

So does the commit's accept walk with the round's counters and result row (``triton_accept``: one
program, where ``FastDecoder._accept_walk`` runs ~35 tiny kernels); ``DDTREE_DIAG_ACCEPT_KERNEL=off``
turns off that one alone.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from ddtree_diag.engine.arch import norm_style
from ddtree_diag.engine.rope import apply_rope


def mode() -> str:
    return os.environ.get("DDTREE_DIAG_KERNELS", "auto").strip().lower() or "auto"


@functools.cache
def _kernel_module(name: str):
    """``ddtree_diag.engine.fast.<name>`` (a Triton kernels module), or None where Triton cannot be
    imported: the PyTorch ops run instead."""
    try:
        return importlib.import_module(f"ddtree_diag.engine.fast.{name}")
    except Exception:  # no triton, or one that cannot load here
        return None


def _triton():
    return _kernel_module("triton_kernels")


def _triton_tree():
    return _kernel_module("triton_tree")


def _triton_attention():
    return _kernel_module("triton_attention")


def _triton_gdn():
    return _kernel_module("triton_gdn")


def _triton_gdn_state():
    return _kernel_module("triton_gdn_state")


def _triton_topk():
    return _kernel_module("triton_topk")


def _triton_argmax():
    return _kernel_module("triton_argmax")


def _triton_accept():
    return _kernel_module("triton_accept")


def switched_off(variable: str) -> bool:
    """Whether the environment turns a fast-path feature off (``DDTREE_DIAG_<NAME>_KERNEL=off`` for
    one kernel, ``DDTREE_DIAG_COMPILE_AHEAD=off``)."""
    return os.environ.get(variable, "").strip().lower() == "off"


def tree_kernel(device: torch.device):
    """The tree kernel's module when the draft tree on ``device`` is built by it, else None."""
    setting = mode()
    if switched_off("DDTREE_DIAG_TREE_KERNEL"):
        return None
    if setting == "off" or (setting == "auto" and device.type != "cuda") or torch.compiler.is_compiling():
        return None
    return _triton_tree()


def attention_kernel(q: torch.Tensor, cache_k: torch.Tensor):
    """The split-key attention kernel's module when rows ``q`` [1, heads, rows, head_dim] (a
    verify's tree rows, or the draft's noise block) attend to ``cache_k`` [1, kv_heads, capacity,
    head_dim] through it, else None (SDPA runs)."""
    if switched_off("DDTREE_DIAG_ATTENTION_KERNEL"):
        return None
    if _use(q) is None or cache_k.dtype != q.dtype or cache_k.device != q.device:
        return None
    if q.dim() != 4 or q.shape[0] != 1 or q.stride(-1) != 1 or cache_k.stride(-1) != 1:
        return None
    # head_dim <= 256: the 8B's 128 and Qwen3.6-27B's 256 (32-row query blocks there); wider
    # heads keep SDPA
    if q.shape[1] % cache_k.shape[1] != 0 or q.shape[3] > 256:
        return None
    return _triton_attention()


def gdn_solver(conv_out: torch.Tensor, module: torch.nn.Module, a: torch.Tensor, b: torch.Tensor):
    """The Gated DeltaNet solve kernel's module when ``module``'s tree rows (conv output
    ``conv_out`` [N, conv_dim], gate inputs ``a``, ``b`` [N, Hv]) are solved by it, else None
    (``gdn.parallel_gated_delta`` runs)."""
    if switched_off("DDTREE_DIAG_GDN_KERNEL"):
        return None
    if _use(conv_out) is None or conv_out.dim() != 2 or conv_out.stride(-1) != 1:
        return None
    if a.stride(-1) != 1 or b.stride(-1) != 1 or not _solvable(module):
        return None
    return _triton_gdn()


def _solvable(module: torch.nn.Module) -> bool:
    """Whether the solve kernel takes a Gated DeltaNet layer of this shape."""
    if not hasattr(module, "A_log") or not hasattr(module, "dt_bias"):
        return False
    return not (module.num_v_heads % module.num_k_heads or module.head_k_dim > 256 or module.head_v_dim > 256)


def gdn_path_table(
    ancestors: torch.Tensor, hidden: torch.Tensor, max_path: int, module: torch.nn.Module
) -> torch.Tensor | None:
    """The path solve's table of tree rows' root paths (``triton_gdn.path_table``), built once a
    verify for every Gated DeltaNet layer's solve, where the solve kernel runs on ``hidden``'s
    device and dtype for layers like ``module`` (a target's Gated DeltaNet layers are alike);
    else None."""
    if switched_off("DDTREE_DIAG_GDN_KERNEL") or _use(hidden) is None or not _solvable(module):
        return None
    solve = _triton_gdn()
    return solve.path_table(ancestors, max_path) if max_path <= solve.PATH_LIMIT else None


def gdn_state_kernels(x: torch.Tensor, activation: str | None = "silu"):
    """The Gated DeltaNet conv / commit kernels' module when a layer's tree rows (``x``: its
    pre-conv inputs, or its recurrent state at commit) go through them, else None (``gdn``'s
    PyTorch functions run). Same switch as the solve: ``DDTREE_DIAG_GDN_KERNEL``."""
    if switched_off("DDTREE_DIAG_GDN_KERNEL"):
        return None
    if activation not in (None, "silu", "swish") or _use(x) is None:
        return None
    return _triton_gdn_state()


TOPK_KERNEL_MAX_K = 64


def topk_keys_kernel(values: torch.Tensor):
    """The top-k kernel's module when ``tree.ranked_top_k``'s int64 keys for ``values`` are formed
    by it (``ranked_keys``: where ``topk_kernel`` leaves the ranking to ``torch.topk``), else None."""
    setting = os.environ.get("DDTREE_DIAG_TOPK_KERNEL", "").strip().lower()
    if setting == "off" or _use(values) is None or values.dtype != torch.float32:
        return None
    if not values.is_cuda and setting != "on":
        return None  # the interpreter: only where asked for (the module docstring says why)
    if values.dim() != 2 or values.stride(-1) != 1 or values.shape[0] == 0 or values.shape[1] >= 2**31:
        return None
    return _triton_topk()


def topk_kernel(values: torch.Tensor, k: int):
    """The top-k kernel's module when ``tree.ranked_top_k(values, k)`` runs through it, else None
    (``torch.topk`` on int64 keys runs)."""
    if topk_keys_kernel(values) is None:
        return None
    # Up to TOPK_KERNEL_MAX_K only: on an H200 the kernel wins at k = 16 / 64 (0.045 / 0.091 ms
    # against torch's 0.187 / 0.196) but barely at 256 (0.160 / 0.213), where its sorting networks
    # take seconds to compile on a cold Triton cache (a budget-256 first request: 12.9 s against
    # 0.4 s). Indices are int32 in the kernel.
    if not 1 <= k <= min(values.shape[1], TOPK_KERNEL_MAX_K):
        return None
    return _triton_topk()


def argmax_kernel(logits: torch.Tensor):
    """The argmax kernel's module when ``logits.argmax(dim=-1)`` for ``logits`` [rows, vocab] runs
    through it, else None (``torch.argmax`` runs)."""
    # fp16 too: a comparison needs no rounding rule (``_DTYPES`` leaves fp16 out for the norms')
    if switched_off("DDTREE_DIAG_ARGMAX_KERNEL") or _use(logits, (*_DTYPES, torch.float16)) is None:
        return None
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return None
    if 0 in logits.shape or logits.shape[1] >= 2**31 - 1:  # indices are int32 in the kernel
        return None
    return _triton_argmax()


def accept_kernel(tokens: torch.Tensor):
    """The accept walk kernel's module when a verify round's tree (``tokens`` [rows] int64) is
    walked by it at commit, else None (``FastDecoder._accept_walk``'s PyTorch ops run)."""
    if switched_off("DDTREE_DIAG_ACCEPT_KERNEL") or _use(tokens, (torch.long,)) is None:
        return None
    return _triton_accept()


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``logits`` [rows, vocab], written into ``out`` (int64 [rows])
    when given; the split Triton argmax where it runs, identical to torch's (first index of the
    maximum, NaN above everything)."""
    module = argmax_kernel(logits)
    fits = out is None or (out.dtype == torch.long and out.shape == logits.shape[:1] and out.device == logits.device)
    if module is None or not fits:
        if out is None:
            return logits.argmax(dim=-1)
        return out.copy_(logits.argmax(dim=-1))
    return module.argmax(logits, out)


def available() -> bool:
    """Whether the fused kernels can run in this process (the setting allows them, Triton imports)."""
    return mode() != "off" and _triton() is not None


def active(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernels run for ``dtype`` tensors on ``device`` (outside ``torch.compile``)."""
    setting = mode()
    usable = setting == "on" or (setting == "auto" and device.type == "cuda")
    return usable and dtype in _DTYPES and _triton() is not None


# fp16 is left to the modules: Triton folds fp16 round trips as it does bf16 ones (see
# triton_kernels._rounded), and no fp16 run has checked a bit-exact rounding for it.
_DTYPES = (torch.float32, torch.bfloat16)


def _use(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _DTYPES):
    """The kernels module when the kernels should run on ``x`` (of one of ``dtypes``), else None."""
    setting = mode()
    if setting == "off" or (setting == "auto" and not x.is_cuda) or x.dtype not in dtypes:
        return None
    if torch.compiler.is_compiling():
        return None
    return _triton()


def _norm_params(
    module: torch.nn.Module, x: torch.Tensor, gated: bool = False
) -> tuple[torch.Tensor, float, bool] | None:
    """(weight, eps, offset) of an RMSNorm the kernels reproduce for ``x``, else None. ``gated``:
    the module must be a gated (SiLU) output norm; else it must not be one."""
    style = norm_style(module)
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if style is None or (style == "gated") != gated or not isinstance(weight, torch.Tensor):
        return None
    if not isinstance(eps, float) or (gated and getattr(module, "activation", None) != "silu"):
        return None
    if weight.shape != (x.shape[-1],) or weight.device != x.device or not weight.is_contiguous():
        return None
    if style != "offset" and weight.dtype != x.dtype:
        return None  # the module's output would be promoted to the weight's dtype
    return weight, eps, style == "offset"


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an RMSNorm module, one fused kernel where possible."""
    kernels, params = _use(x), None
    if kernels is not None and x.stride(-1) == 1:
        params = _norm_params(module, x)
    if params is None:
        return module(x)
    return kernels.rms_norm(x, *params)[0]


def add_rms_norm(
    module: torch.nn.Module, hidden: torch.Tensor, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, module(hidden + delta)): the residual add and the next norm in one kernel."""
    kernels, params = _use(hidden), None
    same_layout = hidden.shape == delta.shape and hidden.dtype == delta.dtype
    if kernels is not None and same_layout and hidden.stride(-1) == 1 and delta.stride(-1) == 1:
        params = _norm_params(module, hidden)
    if params is None:
        total = hidden + delta
        return total, module(total)
    normed, total = kernels.rms_norm(hidden, *params, delta=delta)
    return total, normed


def gated_rms_norm(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``module(x, gate.reshape(x.shape))`` for a Gated DeltaNet output norm (norm, weight, times
    silu(gate)). x [rows, head_dim]; gate x's shape or [tokens, heads, head_dim] with rows = tokens
    x heads (any strides: the kernel reads a column slice of the projection output in place)."""
    kernels, params = _use(x), None
    fits = gate.shape == x.shape or (
        gate.dim() == 3 and x.dim() == 2 and gate.shape[0] * gate.shape[1] == x.shape[0] and gate.shape[2] == x.shape[1]
    )
    if kernels is not None and fits and x.dim() == 2 and x.stride(-1) == 1 and gate.stride(-1) == 1:
        params = _norm_params(module, x, gated=True)
    if params is None:
        return module(x, gate.reshape(x.shape))
    return kernels.rms_norm(x, *params, gate=gate)[0]


def gated_norm_for_solve(
    module: torch.nn.Module, gate: torch.Tensor
) -> tuple[torch.Tensor, float, bool, torch.Tensor] | None:
    """(weight, eps, offset, gate) for the solve kernel (``triton_gdn.tree_solve``'s ``out_norm``)
    to apply a Gated DeltaNet output norm ``module`` to the output rows it makes: ``gate`` [tokens,
    heads, head_dim] (any token and head strides; the output has its dtype and device), else None
    (``gated_rms_norm`` runs after the solve)."""
    if _use(gate) is None or gate.dim() != 3 or gate.stride(-1) != 1:
        return None
    params = _norm_params(module, gate, gated=True)
    return None if params is None else (*params, gate)


def norm_rope(module: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope(module(x).transpose(1, 2), cos, sin)`` for x [1, rows, heads, head_dim]: a per-head
    q/k norm and rotary (full or partial) in one kernel. Returns [1, heads, rows, head_dim]."""
    kernels, params = _use(x), None
    if kernels is not None and _rope_fits(x, cos, sin):
        params = _norm_params(module, x)
    if params is None:
        return apply_rope(module(x).transpose(1, 2), cos, sin)
    return kernels.norm_rope(x, *params, cos, sin).transpose(1, 2)


def norm_rope_cache(
    attn: torch.nn.Module | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    start: torch.Tensor,
) -> torch.Tensor | None:
    """``norm_rope`` (``attn`` None: ``rope``) of q and k in one kernel that also writes k and v
    [1, rows, kv_heads, head_dim] into the cache layer ``cache_k`` / ``cache_v`` [1, kv_heads,
    capacity, head_dim] at slots start + row (``start`` a 0-d device tensor: ``KVCache.write`` at
    contiguous slots). ``attn``: the attention module holding ``q_norm`` / ``k_norm``. Returns q
    [1, heads, rows, head_dim], bit-identical to ``norm_rope``'s; None where this kernel does not
    apply (nothing written: the caller runs ``norm_rope`` and ``KVCache.write``)."""
    kernels = _use(q)
    if kernels is None or switched_off("DDTREE_DIAG_QKV_KERNEL"):
        return None
    if not (_rope_fits(q, cos, sin) and _rope_fits(k, cos, sin)) or v.shape != k.shape or v.stride(-1) != 1:
        return None
    if q.shape[1] > cache_k.shape[2] or cache_k.shape[1] != k.shape[2] or cache_k.shape[3] != k.shape[3]:
        return None
    same = (k.dtype, v.dtype, cache_k.dtype, cache_v.dtype, k.device, v.device, cache_k.device, cache_v.device)
    if same != (q.dtype,) * 4 + (q.device,) * 4 or cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        return None
    if start.dim() != 0 or start.device != q.device or start.dtype != torch.long:
        return None
    q_norm = k_norm = None
    offset = False
    if attn is not None:
        q_params, k_params = _norm_params(attn.q_norm, q), _norm_params(attn.k_norm, k)
        if q_params is None or k_params is None or q_params[2] != k_params[2]:
            return None
        q_norm, k_norm, offset = q_params[:2], k_params[:2], q_params[2]
    out = kernels.norm_rope_cache(q, k, v, offset, q_norm, k_norm, cos, sin, cache_k, cache_v, start)
    return out.transpose(1, 2)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope(x.transpose(1, 2), cos, sin)`` for x [1, rows, heads, head_dim] (targets without
    q/k norms: Llama, Qwen2, Mistral) in one kernel. Returns [1, heads, rows, head_dim]."""
    kernels = _use(x)
    if kernels is None or not _rope_fits(x, cos, sin):
        return apply_rope(x.transpose(1, 2), cos, sin)
    return kernels.norm_rope(x, None, 0.0, False, cos, sin).transpose(1, 2)


def _rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    rows, rotary = x.shape[1], cos.shape[-1]
    return (
        x.dim() == 4 and x.shape[0] == 1 and x.stride(-1) == 1 and rotary % 2 == 0 and rotary <= x.shape[-1]
        and cos.shape == sin.shape and cos.numel() == rows * rotary and cos.dtype == x.dtype == sin.dtype
        and cos.is_contiguous() and sin.is_contiguous()
    )


def silu_mul(act_fn: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate) * up`` for ``gate_up`` holding gate | up on its last dim; one kernel for SiLU."""
    kernels = _use(gate_up)
    if kernels is not None and _is_silu(act_fn) and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 2 == 0:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


def _is_silu(act_fn: torch.nn.Module) -> bool:
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"
