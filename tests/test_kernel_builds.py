"""Every Triton kernel a decode launches, built for a Hopper GPU (sm_90) on this machine, no GPU.

Under Triton's interpreter the kernel tests run each kernel's Python on CPU tensors, and nothing is
ever compiled: a kernel that the GPU compiler rejects (a name bound before an unrolled loop and
re-bound inside it to another shape, an op the interpreter allows) passes every CPU test and fails
at its first launch on the GPU. Here the compile-ahead pass (``ahead.dry_run``, fake tensors, no
kernel runs) names every launch of a dense and a hybrid target's request as a bf16 model makes
them: the kernel, its arguments' dtypes, its meta-parameters and warps. Triton's own compiler then
builds each for sm_90, through PTX to a cubin (Triton ships ptxas). Integer arguments are built
unspecialized (Triton would also build variants for 1 and multiples of 16).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
triton = pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import ahead, kernels  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, turn_kernels_on  # noqa: E402

pytestmark = [*MARKS, pytest.mark.e2e,  # the builds run in a process of their own
              pytest.mark.skipif(DEVICE != "cpu", reason="a GPU builds the kernels at their launches")]

_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1",
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


ROOT = Path(__file__).resolve().parents[1]


class _Named(Exception):
    """Raised by the stand-in pass once it has named the request's launches: nothing else runs."""


def build_spec(kernel, args: tuple, meta: dict) -> tuple:
    """A launch as Triton's compiler takes it, hashable: (module, kernel name, signature, constexprs,
    options). Stands in for ``ahead.launch_signature`` during the pass."""
    fn = kernel.fn  # the Python function (under the interpreter ``kernel`` is an interpreted one)
    signature, constexprs = [], []
    for index, param in enumerate(inspect.signature(fn).parameters.values()):
        if index < len(args):
            value = args[index]
        elif param.name in meta:
            value = meta[param.name]
        elif param.default is not inspect.Parameter.empty:
            value = param.default
        else:
            raise TypeError(f"{fn.__name__}: no value for {param.name}")
        if "constexpr" in str(param.annotation) or value is None:  # (a string where annotations are)
            signature.append((param.name, "constexpr"))
            constexprs.append((index, value))
        elif isinstance(value, torch.Tensor):
            signature.append((param.name, "*" + _TYPES[value.dtype]))
        elif isinstance(value, bool):
            signature.append((param.name, "i1"))
        elif isinstance(value, int):
            signature.append((param.name, "i32" if -(2**31) <= value < 2**31 else "i64"))
        elif isinstance(value, float):
            signature.append((param.name, "fp32"))
        else:
            raise TypeError(f"{fn.__name__}: no Triton type for argument {param.name}={value!r}")
    options = tuple(sorted((name, meta[name]) for name in _OPTIONS if name in meta))
    return fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), options


def build_for_sm90(specs: list[tuple]) -> list[str | None]:
    """Each spec built for sm_90 in a process without the interpreter: None, or why not."""
    launches = [
        {"module": module, "kernel": name, "signature": signature, "constexprs": constexprs, "options": dict(options)}
        for module, name, signature, constexprs, options in specs
    ]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.sm90_build"], input=json.dumps(launches), capture_output=True,
        text=True, env=env, cwd=ROOT, timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the build process failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def can_build():
    """Skip where this Triton cannot build for sm_90 here at all (another compile API, no ptxas):
    a one-line kernel is the judge, so a real kernel's failure below is the kernel's."""
    probe = ("tests.support.sm90_build", "_copy", (("src", "*fp32"), ("dst", "*fp32"), ("n", "i32"),
                                                  ("BLOCK", "constexpr")), ((3, 16),), ())
    try:
        verdict = build_for_sm90([probe])[0]
    except Exception as exc:  # any way this environment cannot build
        verdict = f"{type(exc).__name__}: {exc}"
    if verdict is not None:
        pytest.skip(f"this Triton cannot build for sm_90 here: {verdict}")


def launches_of_a_request(monkeypatch, engine, **request) -> set[tuple]:
    """The build specs of every launch the compile-ahead pass names for ``request``'s stages."""
    named: set[tuple] = set()

    def name_only(stage_fns, keep=(), workers=None, identity=None):
        named.update(ahead.dry_run(stage_fns, keep))
        raise _Named

    engine.use_path("fast-nograph")
    engine.decoder("fast-nograph").compile_ahead = True  # as on CUDA
    with monkeypatch.context() as patch, pytest.raises(_Named):
        patch.setattr(ahead, "compile_ahead", name_only)
        patch.setattr(ahead, "launch_signature", build_spec)
        engine.generate_ids(fx.PROMPTS[0], stop_token_ids=[], **request)
    return named


# Qwen3.6-27B's heads on a narrow model: the kernels' tiles (head dims 256 and 128, three value heads
# a key head) as the 27B's verify builds them
HEADS_27B = dict(num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.mark.parametrize("target_kind", ["dense", "hybrid", "hybrid-27b-heads"])
def test_every_kernel_a_request_launches_builds_for_sm90(can_build, monkeypatch, tmp_path, target_kind):
    if target_kind.startswith("hybrid"):  # Gated DeltaNet layers and gated-query attention (Qwen3.5 style)
        heads = HEADS_27B if target_kind == "hybrid-27b-heads" else {}
        target = fx.make_hybrid_target(tmp_path / "t", pattern="LLAL", **heads)
        draft = fx.make_draft(tmp_path / "d", block_size=4, layer_ids=(0, 2), layers=1)
    else:
        target, draft = fx.make_target(tmp_path / "t"), fx.make_draft(tmp_path / "d", block_size=4)
    engine = load_engine(target, draft, device="cpu", dtype="bf16")
    turn_kernels_on(monkeypatch, on=("DDTREE_DIAG_TOPK_KERNEL",))
    specs: set[tuple] = set()
    requests = [dict(tree_budget=8, max_tokens=6), dict(tree_budget=8, max_tokens=6, temperature=0.8, seed=1)]
    if target_kind == "dense":  # a top-k past the Triton top-k's k: its keys kernel, then torch.topk
        requests.append(dict(tree_budget=kernels.TOPK_KERNEL_MAX_K + 36, max_tokens=6))
    for request in requests:
        if "seed" in request:  # the path solve with a key head's value heads in one program, as at 257 rows
            monkeypatch.setattr(kernels._triton_gdn(), "SHARE_HEADS_FROM", 0)
        specs |= launches_of_a_request(monkeypatch, engine, **request)
    names = {spec[1] for spec in specs}
    assert {"_rms_norm_kernel", "_build_tree_kernel", "_tree_rows_kernel", "_top_k_pass",
            "_argmax_chunk_kernel"} <= names, names
    if target_kind == "dense":
        assert "_keys_kernel" in names, names
    if target_kind != "dense":
        assert {"_conv_rows_kernel", "_path_prep_kernel", "_path_solve_kernel", "_commit_kernel"} <= names, names
    ordered = sorted(specs, key=repr)
    failed = [
        f"{spec[1]} {({spec[2][index][0]: value for index, value in spec[3]})}: {verdict}"
        for spec, verdict in zip(ordered, build_for_sm90(ordered), strict=True) if verdict is not None
    ]
    assert not failed, "\n".join(failed)
