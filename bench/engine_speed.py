"""Engine speed: eager vs fast rounds on random-weight Qwen3-0.6B / Qwen3-8B-shaped targets.

Prints, per shape and decode path (eager = the readable reference loop, fast = engine/fast:
static caches, device tree/accept, CUDA graphs on a GPU), ms per decode round with the stage
breakdown (draft, tree, verify, commit), tok/s and TTFT for AR and tree budgets 16/64/256 at
block size 16, plus the memory-bandwidth bound of one target forward (weight bytes / the card's
HBM bandwidth: 4.8 TB/s on an H200, 3.35 on an H100) and verify's share of it. Random weights:
acceptance is ~1 token per round, so every round verifies a full tree — this is the cost of a
round, not a speedup.

    python -m bench.engine_speed                 # CUDA: 0.6b and 8b, bf16 (~5 min on an H200)
    python -m bench.engine_speed --small         # CPU smoke run: a small shape, fp32
    python -m bench.engine_speed --small --profile   # + torch.profiler top ops (on by default with CUDA)

With $OUT set, the printed report is also written to $OUT/engine_speed-<shapes>.txt (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.graph_timing import device_bandwidth
from ddtree_diag.engine.divergence import first_divergence
from ddtree_diag.engine.draft import DFlashDraft, DraftConfig
from ddtree_diag.engine.fast.ahead import start_workers
from ddtree_diag.engine.generate import DECODE_PATHS, Engine
from ddtree_diag.engine.target import TargetModel

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied embeddings)
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "small": (256, 6, 8, 4, 32, 768, 8192, False),  # CPU smoke run
    # Hybrid (Gated DeltaNet) targets, 3 linear-attention layers to 1 full: Qwen3.6-27B's text
    # model as its public config gives it, and a CPU-sized one.
    "qwen3.6-27b": (5120, 64, 24, 4, 256, 17408, 248320, False),
    "hybrid-small": (256, 8, 4, 2, 64, 768, 8192, False),
}
# Gated DeltaNet dims of the hybrid shapes: (key heads, value heads, key dim, value dim, conv kernel)
LINEAR = {"qwen3.6-27b": (16, 48, 128, 128, 4), "hybrid-small": (4, 8, 32, 32, 4)}
# The draft of a hybrid shape (z-lab's Qwen3.6-27B DFlash: 32/8 heads of 128; a sliding layer)
DRAFT_HEADS = {"qwen3.6-27b": (32, 8, 128), "hybrid-small": (4, 2, 64)}
WARMUP_TOKENS = 24  # per config before the timed run (small runs: the whole run, shapes fully warm)
LINES: list[str] = []
COMPILES: list[tuple[str, float]] = []  # (kernel, seconds) of every Triton compile seen, in order
RECORDS: list[dict] = []
EAGER_TOKENS: dict[tuple[str, int], list[int]] = {}
PATH_TOKENS: dict[tuple[str, str, int], list[int]] = {}  # (shape, path, budget): the official check's


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def draft_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """Evenly spaced target layers from 1 to target_layers-3 (z-lab's convention)."""
    start, end = 1, target_layers - 3
    return [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]


def target_model(shape: str) -> torch.nn.Module:
    """The random HF target of a shape (built on the current default device and dtype)."""
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=40960, tie_word_embeddings=tied,
    )
    if shape in LINEAR:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        key_heads, value_heads, key_dim, value_dim, kernel = LINEAR[shape]
        config = Qwen3_5TextConfig(
            **common, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=key_dim,
            linear_value_head_dim=value_dim, linear_conv_kernel_dim=kernel,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        )
        return Qwen3_5ForCausalLM(config).eval()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**common)).eval()


def build(shape: str, device: str, dtype: torch.dtype, block_size: int, draft_layers: int) -> Engine:
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, _tied = SHAPES[shape]
    draft_heads, draft_kv_heads, draft_head_dim = DRAFT_HEADS.get(shape, (heads, kv_heads, head_dim))
    start_workers(device, dtype)  # as load_engine does before the weights load (engine/fast/ahead.py)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype (8B in fp32 would not be cheap)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = target_model(shape)
            draft_config = DraftConfig(
                hidden_size=hidden, num_hidden_layers=draft_layers, num_attention_heads=draft_heads,
                num_key_value_heads=draft_kv_heads, intermediate_size=inter,
                target_layer_ids=draft_layer_ids(layers, draft_layers), mask_token_id=vocab - 1,
                block_size=block_size, num_target_layers=layers, head_dim=draft_head_dim, vocab_size=vocab,
            )
            if shape in LINEAR:  # as the published Qwen3.6 draft: sliding layers, one full
                draft_config.layer_types = ["sliding_attention"] * (draft_layers - 1) + ["full_attention"]
                draft_config.sliding_window = 2048
            draft = DFlashDraft(draft_config)
            with torch.no_grad():
                for name, p in draft.named_parameters():
                    if "norm" not in name:
                        p.normal_(0, 0.02)
            draft = draft.eval()
    finally:
        torch.set_default_dtype(previous)
    return Engine(TargetModel(model, max_len=1024), tokenizer=None, draft=draft)


def run_path(engine: Engine, path: str, prompt: list[int], budgets: list[int], new_tokens: int, shape: str,
             bound_ms: float) -> None:
    """One decode path over the budgets. ``<path>-unfused``: that path with the fused Triton
    kernels off (DDTREE_DIAG_KERNELS=off), on a decoder of its own, for the comparison."""
    unfused = path.endswith("-unfused")
    real_path = path.removesuffix("-unfused")
    previous = os.environ.get("DDTREE_DIAG_KERNELS")
    engine._decoders.pop(real_path, None)  # stages are captured with the kernel setting of their time
    if unfused:
        os.environ["DDTREE_DIAG_KERNELS"] = "off"
    try:
        _run_budgets(engine, path, real_path, prompt, budgets, new_tokens, shape, bound_ms)
    finally:
        if unfused:
            engine._decoders.pop(real_path, None)
            if previous is None:
                os.environ.pop("DDTREE_DIAG_KERNELS", None)
            else:
                os.environ["DDTREE_DIAG_KERNELS"] = previous


def _run_budgets(engine: Engine, path: str, real_path: str, prompt: list[int], budgets: list[int], new_tokens: int,
                 shape: str, bound_ms: float) -> None:
    engine.use_path(real_path)
    blas_said: set[str] = set()  # stage shapes whose BLAS choice was printed
    for budget in dict.fromkeys([0, *budgets]):  # AR first and once, also where budgets names 0
        # warm-up: same shapes (and, fast on CUDA, graph capture and kernel compiles) before the
        # timed run; its wall time is what a first request of this shape costs in a fresh process
        cuda = engine.device.type == "cuda"
        if cuda:  # peak memory of this budget alone (weights included): its caches, graphs, buffers
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        compiled_before = len(COMPILES)
        first = engine.generate_ids(
            prompt, tree_budget=budget, max_tokens=min(new_tokens, WARMUP_TOKENS), stop_token_ids=[]
        )
        first_s = time.perf_counter() - started
        compiles = COMPILES[compiled_before:]
        ahead = first.extras.get("compile_ahead")
        if ahead and ahead.get("skipped"):
            say(f"  (first request, budget {budget}: no compile-ahead pass: one ran for these stages before)")
        elif ahead:  # the kernels compiled in parallel before the stages ran (engine/fast/ahead.py)
            failed = f"; {ahead['error']}" if "error" in ahead else ""
            where = f" in {ahead['compiled_in']}" if "compiled_in" in ahead else ""
            say(f"  (first request, budget {budget}: compiled ahead {ahead['kernels']} kernels of "
                f"{ahead['launches']} launches{where} in {ahead['seconds']:.1f} s{failed})")
        for stage, choice in first.extras.get("blas_choices", {}).items():  # measured at capture (graphs.Stage)
            if stage in blas_said:
                continue
            blas_said.add(stage)
            times = " / ".join(f"{name} {ms:.2f}" for name, ms in choice.items() if isinstance(ms, float))
            why = f"; the other: {choice['error']}" if "error" in choice else ""
            why += "; measured by an earlier process" if choice.get("stored") else ""
            say(f"  (first request, budget {budget}: {stage} GEMMs through {choice['chosen']}; "
                f"replays {times} ms{why})")
        if compiles:  # ahead: hooks time submit to finish; else each kernel's compile at its launch
            slowest = ", ".join(f"{name} {s:.2f}" for name, s in sorted(compiles, key=lambda c: -c[1])[:6])
            say(f"  (first request, budget {budget}: {len(compiles)} Triton compiles, "
                f"{sum(s for _, s in compiles):.1f} s; slowest: {slowest})")
        result = engine.generate_ids(prompt, tree_budget=budget, max_tokens=new_tokens, stop_token_ids=[])
        # tokens vs the eager path's at this budget (fp32: must match; bf16: may part where the
        # target's best tokens are a few rounding steps apart: "@i~" a near-tie at output token i,
        # "@i!" not; engine/divergence.py's rule)
        key = (shape, budget)
        if path == "eager":
            EAGER_TOKENS[key] = result.token_ids
        PATH_TOKENS[(shape, path, budget)] = result.token_ids
        reference = EAGER_TOKENS.get(key)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0  # before the judging forward
        same, divergence = "-", None
        if reference is not None and path != "eager":
            divergence = first_divergence(engine.target.hf, prompt, reference, result.token_ids)
            same = "yes" if divergence is None else f"@{divergence.index}{'~' if divergence.near_tie else '!'}"
        rounds = max(result.decode_rounds, 1)
        per = {k: 1000 * v / rounds for k, v in result.stage_times.items()}
        ms_round = 1000 * (result.e2e_s - result.ttft_s) / rounds
        tau = result.mean_acceptance_length or 0
        share = 100 * bound_ms / per["verify"] if per["verify"] > 0 else 0.0
        fallbacks = result.extras.get("fast_tree_fallbacks", "-")
        for error in result.extras.get("cuda_graph_errors", []):
            say(f"  (a stage ran without a CUDA graph: {error})")
        if divergence is not None:
            say(f"  ({path} at budget {budget} against eager: {divergence.describe()})")
        say(
            f"{path:>12} {budget if budget else 'AR':>6} {result.decode_rounds:>6} {tau:>5.2f} "
            f"{ms_round:>9.2f} {per['draft']:>7.2f} {per['tree']:>7.2f} {per['verify']:>7.2f} "
            f"{per['commit']:>7.2f} {result.decode_tokens_per_second or 0:>8.1f} {1000 * result.ttft_s:>8.1f} "
            f"{share:>6.0f}% {fallbacks!s:>5} {same:>5} {first_s:>6.1f} {peak_gib:>7.1f}"
        )
        RECORDS.append({
            "shape": shape, "path": path, "budget": budget, "rounds": result.decode_rounds, "tau": tau,
            "ms_per_round": ms_round, "stage_ms_per_round": per,
            "tokens_per_second": result.decode_tokens_per_second, "ttft_ms": 1000 * result.ttft_s,
            "verify_bandwidth_share": share / 100, "tree_fallbacks": fallbacks, "same_as_eager": same,
            "divergence": asdict(divergence) if divergence is not None else None,
            "first_request_s": first_s, "peak_gib": peak_gib,
            "triton_compiles": len(compiles), "triton_compile_s": sum(s for _, s in compiles),
            "compile_ahead": ahead,
        })


def log_triton_compiles() -> bool:
    """Record each Triton compile's kernel and seconds in COMPILES through Triton's JIT hooks (the
    pre-compile hook starts a clock, the post-compile hook stops it): what a first request spends
    compiling. False where this Triton has no such hooks."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    started: dict[str, float] = {}

    def before(*, key: object, fn: object, **_: object) -> bool:
        started[str(key)] = time.perf_counter()
        return False  # False: go on and compile

    def after(*, key: object, fn: object, **_: object) -> bool:
        begun = started.pop(str(key), None)
        if begun is not None:
            COMPILES.append((getattr(fn, "name", "?"), time.perf_counter() - begun))
        return False

    runtime.jit_cache_hook = before
    runtime.jit_post_compile_hook = after
    return True


def run_official(engine: Engine, prompt: list[int], args: argparse.Namespace, shape: str) -> None:
    """The official DDTree code on the same target and draft (weights shared), same prompt and
    lengths; then each of our paths' speed-up over it per budget."""
    import tempfile

    from bench.official import load_official, load_official_draft, official_round_ms
    from ddtree_diag.engine.draft import save_draft

    official = load_official(args.official_dir)
    with tempfile.TemporaryDirectory() as directory:
        save_draft(engine.draft, engine.draft.config, directory)
        draft = load_official_draft(official, directory, engine.dtype, engine.device)
    ours = {(r["path"], r["budget"]): r["ms_per_round"] for r in RECORDS if r["shape"] == shape}
    for budget in dict.fromkeys([0, *args.budgets]):  # AR once, also where --budgets names 0
        official_round_ms(official, draft, engine.target.hf, prompt, budget, WARMUP_TOKENS, args.block_size)
        # the official round is host bound and varies ~20-60 % between runs: take its best of
        # --official-repeats runs (the speed-ups are against that) and report the spread
        runs = [
            official_round_ms(official, draft, engine.target.hf, prompt, budget, args.new_tokens, args.block_size)
            for _ in range(max(args.official_repeats, 1))
        ]
        result = min(runs, key=lambda r: r["ms_per_round"])
        spread = [r["ms_per_round"] for r in runs]
        per = result["stage_ms_per_round"]
        speedups = "  ".join(
            f"{path} {result['ms_per_round'] / ours[(path, budget)]:.1f}x" for path in args.paths
            if ours.get((path, budget))
        )
        # its tokens against each of our paths' (fp32: must match; bf16: near-ties by the same rule)
        sames = {}
        for path in args.paths:
            theirs, mine = result["tokens"], PATH_TOKENS.get((shape, path, budget))
            if mine is None:
                continue
            divergence = first_divergence(engine.target.hf, prompt, theirs, mine)
            sames[path] = "same" if divergence is None else f"@{divergence.index}{'~' if divergence.near_tie else '!'}"
            if divergence is not None:
                say(f"  ({path} at budget {budget} against the official code: {divergence.describe()})")
        say(f"{'official':>12} {budget if budget else 'AR':>6} {result['rounds']:>6} {result['tau']:>5.2f} "
            f"{result['ms_per_round']:>9.2f} {per.get('draft', 0):>7.2f} "
            f"{per.get('tree_build', 0) + per.get('tree_compile', 0):>7.2f} {per.get('verify', 0):>7.2f} "
            f"{per.get('commit', 0):>7.2f}  speed-up: {speedups}  (best of {len(runs)}: "
            f"{min(spread):.1f}-{max(spread):.1f} ms)  tokens: "
            f"{', '.join(f'{path} {same}' for path, same in sames.items()) or '-'}")
        RECORDS.append({"shape": shape, "path": "official", "budget": budget, "official_runs_ms": spread,
                        "same_as_paths": sames, **{
            k: v for k, v in result.items() if k != "tokens"}})
    del draft


def profile_round(engine: Engine, prompt: list[int], budget: int, cuda: bool) -> None:
    """torch.profiler over a few fast rounds: top ops by device (or CPU) time, and how busy the
    device was — the evidence of what bounds a round."""
    from torch.profiler import ProfilerActivity, profile

    if engine.decode_path == "eager":  # else: the path the run's --paths left it on
        engine.use_path("fast")
    engine.generate_ids(prompt, tree_budget=budget, max_tokens=8, stop_token_ids=[])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        result = engine.generate_ids(prompt, tree_budget=budget, max_tokens=6, stop_token_ids=[])
    rounds = max(result.decode_rounds, 1)
    wall_ms = 1000 * (result.e2e_s - result.ttft_s) / rounds
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    say(f"-- profile: fast path, budget {budget}, {rounds} rounds after prefill "
        f"(profiler on: {wall_ms:.2f} ms/round incl. profiler overhead)")
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
    for line in table.splitlines():
        say(line)
    if cuda:
        kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA")
        e2e_ms = 1000 * result.e2e_s
        say(f"device kernel time {kernel_us / 1000:.2f} ms over a {e2e_ms:.2f} ms generation (prefill + "
            f"{rounds} rounds): device busy {100 * kernel_us / 1000 / e2e_ms:.0f}% of the wall time")


def stage_timelines(engine: Engine, budget: int, out_dir: str | None) -> None:
    """Each stage of a budget's steady round replayed alone under torch.profiler: its kernels in
    order, with their device time and the idle gap before each. Summed per kernel name here; the
    whole sequence goes to $OUT/stage_timeline-<budget>.txt. Run after the timed runs: a replayed
    commit moves the decoder's state (the next request resets it)."""
    from torch.profiler import ProfilerActivity, profile

    decoder = engine.decoder(engine.decode_path if engine.decode_path != "eager" else "fast")
    engine.generate_ids([1, 2, 3, 4] * 32, tree_budget=budget, max_tokens=24, stop_token_ids=[])
    rows = budget + 1  # the verify batch (one row for AR)
    picked = {}
    for key, stage in decoder.stages.items():
        name = key[0]
        wanted = {"draft": budget > 0, "tree": budget > 0 and key[-1] == rows, "tree-ar": budget == 0,
                  "verify": key[1] == rows, "commit": key[-1] == rows}
        if wanted.get(name) and stage.graph is not None:
            picked[name] = (key, stage)  # the last (widest attention window) of each
    lines = []
    for name, (key, stage) in picked.items():
        stage.run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stage.run()
            torch.cuda.synchronize()
        kernels = sorted(
            (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
        )
        if not kernels:
            say(f"  ({name}: the profiler saw no kernel)")
            continue
        busy = sum(e.time_range.elapsed_us() for e in kernels)
        span = kernels[-1].time_range.end - kernels[0].time_range.start
        say(f"-- stage {key}: {len(kernels)} kernels, {busy:.1f} us busy over a {span:.1f} us span")
        totals: dict[str, list[float]] = {}
        previous_end = kernels[0].time_range.start
        lines.append(f"== {key}")
        for event in kernels:
            gap = event.time_range.start - previous_end
            previous_end = event.time_range.end
            lines.append(f"{event.time_range.elapsed_us():8.1f} {gap:6.1f}  {event.name[:110]}")
            entry = totals.setdefault(event.name[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
        for kernel, (count, total) in sorted(totals.items(), key=lambda item: -item[1][1])[:14]:
            say(f"  {total:8.1f} us {count:4d}x  {kernel}")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"stage_timeline-{budget}.txt").write_text("\n".join(lines) + "\n")


def run_shape(shape: str, args: argparse.Namespace) -> None:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    started = time.perf_counter()
    engine = build(shape, args.device, dtype, args.block_size, args.draft_layers)
    built = time.perf_counter() - started
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.target.hf.parameters())
    bytes_per_s, bandwidth = device_bandwidth(args.device)
    bound_ms = 1000 * weight_bytes / bytes_per_s
    params = sum(p.numel() for p in engine.target.hf.parameters()) / 1e9
    kind = "hybrid Gated-DeltaNet " if engine.target.hybrid else ""
    say(f"\n== {shape}-shaped random {kind}target ({params:.2f}B params, {weight_bytes / 2**30:.2f} GiB), "
        f"{args.draft_layers}-layer draft, block {args.block_size}, {args.dtype} on {args.device} "
        f"(built in {built:.1f}s)")
    say(f"bandwidth bound of one target forward: {weight_bytes / 1e9:.2f} GB / ({bandwidth}) = {bound_ms:.2f} ms "
        "(verify 'bw%' = this / verify ms)")
    gen = torch.Generator().manual_seed(1)
    vocab = engine.target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.prompt_tokens,), generator=gen).tolist()
    if engine.target.hybrid:
        states = ", ".join(f"budget {b}: {engine.target.tree_state_bytes(b) / 2**30:.2f} GiB" for b in args.budgets)
        say(f"per-node recurrent state the eager scan holds ({len(engine.target.linear_layers)} Gated DeltaNet "
            f"layers): {states}; the fast path's parallel solve holds none")
    header = f"{'path':>12} {'budget':>6} {'rounds':>6} {'tau':>5} {'ms/round':>9} {'draft':>7} {'tree':>7} "
    header += f"{'verify':>7} {'commit':>7} {'tok/s':>8} {'TTFT ms':>8} {'bw%':>7} {'fallb':>5} {'=eag':>5}"
    say(header + f" {'1st s':>6} {'peakGiB':>7}")
    for path in args.paths:
        tokens = args.eager_tokens if path == "eager" else args.new_tokens
        try:
            run_path(engine, path, prompt, args.budgets, tokens, shape, bound_ms)
        except Exception as exc:  # one path failing (say torch.compile) must not lose the others' figures
            first_line = (str(exc).strip().splitlines() or [""])[0]
            say(f"{path:>12} failed: {type(exc).__name__}: {first_line}")
    if args.official_dir and not engine.target.hybrid:
        run_official(engine, prompt, args, shape)
    if args.profile:
        budget = args.budgets[0]  # the smallest budget: the goals are tightest there
        try:
            profile_round(engine, prompt, budget, args.device.startswith("cuda"))
        except Exception as exc:  # e.g. a failed compile of the last path: profile the plain fast path
            say(f"profile with {args.paths[-1]} failed ({type(exc).__name__}); profiling 'fast' instead")
            engine.use_path("fast")
            profile_round(engine, prompt, budget, args.device.startswith("cuda"))
    if args.stage_timeline and args.device.startswith("cuda"):
        for budget in args.budgets:
            stage_timelines(engine, budget, os.environ.get("OUT"))
    if args.device.startswith("cuda"):
        say(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small shape, fp32, few tokens (default without CUDA)")
    parser.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument(
        "--paths", default="eager,fast,fast-compile",
        help="comma list of " + ", ".join(DECODE_PATHS) + " (any with '-unfused': without the fused kernels)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per fast run (default 256; small 32)")
    parser.add_argument("--eager-tokens", type=int, default=None, help="tokens per eager run (default 64; small 32)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument(
        "--official-dir", default=None,
        help="directory of the official DDTree code (ddtree.py, dflash.py, model/): measured in the same run",
    )
    parser.add_argument("--official-repeats", type=int, default=1, help="timed official runs per budget (best kept)")
    parser.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.profiler top ops of fast rounds per shape (default: on with CUDA)",
    )
    parser.add_argument(
        "--stage-timeline", action="store_true",
        help="CUDA: each stage of every budget's round replayed alone, its kernels in order (see stage_timelines)",
    )
    args = parser.parse_args()
    small = args.small or not args.device.startswith("cuda")
    args.shapes = (args.shapes or ("small" if small else "0.6b,8b")).split(",")
    args.dtype = args.dtype or ("fp32" if small else "bf16")
    args.profile = (not small) if args.profile is None else args.profile
    args.new_tokens = args.new_tokens or (32 if small else 256)
    args.eager_tokens = args.eager_tokens or (32 if small else 64)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.paths = args.paths.split(",")
    if small:
        torch.set_num_threads(1)  # a shared CPU: one thread gives steadier figures
        global WARMUP_TOKENS
        WARMUP_TOKENS = args.new_tokens
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    if args.device.startswith("cuda"):
        log_triton_compiles()
    say(f"engine_speed: torch {torch.__version__}, device {name}, stage columns in ms per round")
    started = time.perf_counter()
    for shape in args.shapes:
        run_shape(shape.strip(), args)
    say(f"\nengine_speed done in {time.perf_counter() - started:.0f}s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        # one pair of files per shape list, so two runs into one $OUT keep both
        stem = "engine_speed-" + "_".join(shape.strip() for shape in args.shapes)
        (Path(out) / f"{stem}.txt").write_text("\n".join(LINES) + "\n")
        (Path(out) / f"{stem}.json").write_text(json.dumps(RECORDS, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
