"""Triton cache keys of the project's kernels in a fresh process (``tests/test_engine_ahead_workers.py``).

Run as a script without ``TRITON_INTERPRET`` (interpreted functions have no cache key):
``python -m tests.support.cache_keys NAME,NAME,...`` touches those kernels' keys in that order
first, as a process whose first launches came in that order would, then prints one JSON object:
every kernel's key, and the order ``settle_cache_keys`` computed the argmax module's keys in.

With ``--merge-first``, Triton's dependency walk merges a callee's global constants into its
caller before it computes the callee's key, as Triton did before 3.9 (the order that made keys
depend on which kernel a process touched first); the check then holds on any Triton.
"""

from __future__ import annotations

import importlib
import json
import sys


def merge_first(finder, func) -> None:
    finder.used_global_vals.update(func.used_global_vals)  # empty where func's key is not computed yet
    finder.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))


def main() -> None:
    from triton.runtime import jit

    if "--merge-first" in sys.argv:
        jit.DependenciesFinder._update_hash = merge_first
    names = [name for name in sys.argv[1].split(",") if name]
    modules = {name: importlib.import_module(f"ddtree_diag.engine.fast.{name}")
               for name in ("triton_argmax", "triton_kernels", "triton_gdn", "triton_attention")}
    for name in names:
        getattr(modules["triton_argmax"], name).cache_key  # noqa: B018 - touching computes the key
    from ddtree_diag.engine.fast import ahead

    keys = {f"{module_name}.{name}": value.cache_key
            for module_name, module in modules.items()
            for name, value in vars(module).items() if isinstance(value, jit.JITFunction)}
    order = [fn.fn.__name__ for fn in ahead.settle_cache_keys(vars(modules["triton_argmax"]))]
    print(json.dumps({"keys": keys, "settled": order}))


if __name__ == "__main__":
    main()
