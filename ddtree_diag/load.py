"""The load sweep: does speculation pay at this concurrency?

At each level N (``--concurrency 1,4,16`` or a matrix's ``[axes] concurrency``) the matrix's
speculative cases run as a closed loop: N workers, each sending the next request as soon as its
previous one ended, until the level's request count is sent (default ``max(2N, cases)``) or its
time budget is spent (default 60 s: no request starts after it; those in flight finish). The
same request sequence then goes to the baseline (the lossless baseline's spec: ``budget0``,
``url:URL``; ``engine`` only for an in-process run, since the engine on this machine says
nothing about a server's hardware). Each side of a level is summarised in a ``LoadSide``:

- aggregate tok/s = completion tokens of the level's ok requests / the level's wall time (first
  request sent to last answer read); per-request tok/s = a request's tokens / its own time;
- TTFT percentiles (streamed answers only);
- ITL (inter-token latency) per token: the gap between two consecutive streamed chunks divided by
  the tokens the later one carried. The engine says how many each round committed; over HTTP a
  chunk's token count is unknown, so every chunk of a request counts as its mean (completion
  tokens / chunks): one token per chunk gives the plain gap, one speculative round per chunk
  the round's time spread over its tokens;
- mean acceptance (per request; a server-wide /metrics delta over the level when requests carry
  none), drafted tokens, request and failure counts.

The speed-up is aggregate tok/s with speculation / without. The requests are not rows of the
run's results: only the summaries reach the report (``RunReport.load``).

Importing this module is light (no httpx, no torch): ``prepare`` parses plans with it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from ddtree_diag.errors import UsageError
from ddtree_diag.records import PERCENTILES, LoadLevel, LoadSide, ProbeCase, ProbeResult, RunReport

DEFAULT_SECONDS = 60.0  # per level and side: no request starts after it
MAX_LEVEL = 1024  # workers are threads: beyond this a typo, not a load test
ERRORS_KEPT = 3
_LOAD_KEYS = {"seconds", "requests"}
OnStage = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# The plan: levels, request count, time budget


@dataclass
class LoadRequest:
    """What the flags asked for (None: the matrix's, else the default)."""

    levels: list[int] | None = None  # --concurrency with two or more values
    seconds: float | None = None  # --load-seconds
    requests: int | None = None  # --load-requests


@dataclass
class LoadPlan:
    levels: list[int]
    seconds: float = DEFAULT_SECONDS
    requests: int | None = None  # per level and side; None: max(2 × level, speculative cases)

    def request_count(self, level: int, cases: int) -> int:
        return self.requests if self.requests is not None else max(2 * level, cases)

    def describe(self) -> str:
        count = f"{self.requests} requests" if self.requests is not None else "max(2 × level, cases) requests"
        return f"concurrency {', '.join(map(str, self.levels))}; {count} or {self.seconds:g} s per level and side"


def _level(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LEVEL:
        raise UsageError(f"{where}: expected concurrency levels 1-{MAX_LEVEL}, got {value!r}")
    return value


def levels_of(values: Sequence[Any], where: str) -> list[int]:
    """Sorted distinct levels; UsageError names ``where`` for anything else."""
    if not values:
        raise UsageError(f"{where}: expected a non-empty list of concurrency levels")
    return sorted({_level(v, where) for v in values})


def parse_concurrency_flag(text: str | int) -> tuple[int, list[int] | None]:
    """``--concurrency``: (the main run's parallel requests, the sweep's levels or None). One value
    keeps its old meaning (parallel requests for the main run, no sweep from the flag); two or
    more ask for the sweep at those levels, and the main run then runs one request at a time."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    numbers = []
    for part in parts:
        try:
            numbers.append(int(part))
        except ValueError:
            raise UsageError(f"--concurrency: expected an integer or a list such as 1,4,16, got {part!r}") from None
    if len(numbers) == 1:
        if numbers[0] < 1:
            raise UsageError("--concurrency must be >= 1")
        return numbers[0], None
    return 1, levels_of(numbers, "--concurrency")


def resolve_plan(request: LoadRequest, matrix_levels: list[int] | None, table: dict[str, Any],
                 source: str = "<matrix>") -> LoadPlan | None:
    """The sweep a run asked for (flags over the matrix's axis and [load] table); None: no sweep.
    UsageError names the flag or key at fault."""
    unknown = sorted(set(table) - _LOAD_KEYS)
    if unknown:
        raise UsageError(f"{source}: unknown key load.{unknown[0]!r} (known: {', '.join(sorted(_LOAD_KEYS))})")
    seconds: Any = table.get("seconds", DEFAULT_SECONDS)
    where = f"{source}: load.seconds"
    if request.seconds is not None:
        seconds, where = request.seconds, "--load-seconds"
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise UsageError(f"{where} must be a number of seconds > 0, got {seconds!r}")
    requests: Any = table.get("requests")
    where = f"{source}: load.requests"
    if request.requests is not None:
        requests, where = request.requests, "--load-requests"
    if requests is not None and (isinstance(requests, bool) or not isinstance(requests, int) or requests < 1):
        raise UsageError(f"{where} must be an integer >= 1, got {requests!r}")
    levels = request.levels
    if levels is None and matrix_levels:
        levels = levels_of(matrix_levels, f"{source}: axes.concurrency")
    if not levels:
        if request.seconds is not None or request.requests is not None:
            flag = "--load-seconds" if request.seconds is not None else "--load-requests"
            raise UsageError(f"{flag} needs the load sweep: pass --concurrency 1,4,16 (or [axes] concurrency)")
        return None
    return LoadPlan(levels=list(levels), seconds=float(seconds), requests=requests)


# ---------------------------------------------------------------------------------------------
# Statistics (pure)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """{"p50", "p90", "p99"} of ``values`` × ``scale``, rounded; None each for no values."""
    out: dict[str, float | None] = {}
    for name in PERCENTILES:
        value = percentile(values, float(name[1:]))
        out[name] = None if value is None else round(value * scale, 6)
    return out


def itl_samples(result: ProbeResult) -> list[float]:
    """Seconds per token between consecutive streamed chunks (see the module docstring); [] when
    the answer was not streamed or came in one chunk."""
    chunks = result.extras.get("stream_chunks")
    if not isinstance(chunks, list) or len(chunks) < 2:
        return []
    times = [float(c[0]) for c in chunks]
    tokens = [c[1] for c in chunks]
    if any(t is None for t in tokens[1:]):
        if not result.completion_tokens:
            return []
        tokens = [result.completion_tokens / len(chunks)] * len(chunks)
    return [(times[i] - times[i - 1]) / tokens[i] for i in range(1, len(chunks)) if tokens[i] and tokens[i] > 0]


def summarise(results: list[ProbeResult], wall_s: float | None, *, stopped_by_time: bool = False) -> LoadSide:
    """One side of a level from its requests' results."""
    ok = [r for r in results if r.ok]
    side = LoadSide(requests=len(results), failures=len(results) - len(ok), stopped_by_time=stopped_by_time,
                    wall_s=None if wall_s is None else round(wall_s, 6))
    counted = [r for r in ok if r.completion_tokens is not None]
    side.completion_tokens = sum(r.completion_tokens for r in counted)
    if counted and wall_s:
        side.tokens_per_second = round(side.completion_tokens / wall_s, 3)
    per_request = [r.completion_tokens / r.timings.e2e_s for r in counted if r.timings.e2e_s]
    side.request_tokens_per_second_p50 = _rounded(percentile(per_request, 50), 3)
    side.ttft_s = percentiles([r.timings.ttft_s for r in ok if r.timings.ttft_s is not None])
    side.itl_ms = percentiles([s for r in ok for s in itl_samples(r)], scale=1000.0)
    side.e2e_s = percentiles([r.timings.e2e_s for r in ok if r.timings.e2e_s is not None])
    accepts = [r.spec.mean_acceptance_length for r in ok if r.spec.mean_acceptance_length is not None]
    if accepts:
        side.mean_acceptance, side.acceptance_source = round(mean(accepts), 4), "per request"
    drafted = [r.spec.draft_tokens for r in ok if r.spec.draft_tokens is not None]
    side.draft_tokens = sum(drafted) if drafted else None
    side.errors = list(dict.fromkeys(r.error or r.status for r in results if not r.ok))[:ERRORS_KEPT]
    return side


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def speedup(speculative: LoadSide, baseline: LoadSide | None) -> float | None:
    """Aggregate tok/s with speculation / without; None when either is unknown."""
    if baseline is None or speculative.tokens_per_second is None or not baseline.tokens_per_second:
        return None
    return round(speculative.tokens_per_second / baseline.tokens_per_second, 4)


def queueing(levels: list[LoadLevel]) -> str | None:
    """Evidence that requests wait for one another (a single worker): at some level N > 1 the
    speculative side's TTFT p50 is at least half of (N − 1) requests served alone (level 1's
    time p50) and over twice level 1's own TTFT, while a request's own decode (time − TTFT) is
    about what it was alone: they wait, they are not slower. None without that evidence."""
    alone = next((lv for lv in levels if lv.concurrency == 1), None)
    if alone is None:
        return None
    e2e, ttft = alone.speculative.e2e_s.get("p50"), alone.speculative.ttft_s.get("p50")
    if e2e is None or ttft is None:
        return None
    for level in levels:
        waited, took = level.speculative.ttft_s.get("p50"), level.speculative.e2e_s.get("p50")
        n = level.concurrency
        if n < 2 or waited is None or took is None:
            continue
        if waited >= 0.5 * (n - 1) * e2e and waited > 2 * ttft and took - waited <= 1.5 * (e2e - ttft) + 0.005:
            return (f"TTFT p50 grows from {ttft * 1000:.0f} ms alone to {waited * 1000:.0f} ms at concurrency {n} "
                    f"(a request alone takes {e2e * 1000:.0f} ms) while each decodes as fast as alone")
    return None


# ---------------------------------------------------------------------------------------------
# Running a level


@dataclass
class _Level:
    """The requests of one side of one level as they finish (workers append under ``lock``)."""

    results: list[ProbeResult] = field(default_factory=list)
    sent: int = 0
    ended_at: float = 0.0
    stopped_by_time: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_level(backend: Any, cases: list[ProbeCase], concurrency: int, count: int, seconds: float,
              serial: threading.Lock | None = None) -> tuple[list[ProbeResult], float, bool]:
    """A closed loop of ``concurrency`` workers sending ``cases`` in turn (the i-th request is
    ``cases[i % len(cases)]``) until ``count`` were sent or ``seconds`` passed. Returns (results,
    wall seconds, whether time ended it). ``serial``: a lock around each request (a backend that
    runs one at a time). KeyboardInterrupt stops the workers at their next request."""
    state = _Level()
    stop = threading.Event()
    started = time.perf_counter()

    def worker() -> None:
        while not stop.is_set():
            with state.lock:
                index = state.sent
                if index >= count:
                    return
                # the first round always goes out: every level has its N requests in flight
                if index >= concurrency and time.perf_counter() - started >= seconds:
                    state.stopped_by_time = True
                    return
                state.sent += 1
            case = cases[index % len(cases)]
            if serial is not None:
                queued = time.perf_counter()
                with serial:
                    waited = time.perf_counter() - queued
                    result = backend.run(case)
                # as a server's queue would: the wait counts in the request's TTFT and time
                timings = result.timings
                timings.ttft_s = None if timings.ttft_s is None else timings.ttft_s + waited
                timings.e2e_s = None if timings.e2e_s is None else timings.e2e_s + waited
            else:
                result = backend.run(case)
            with state.lock:
                result.seq = index
                state.results.append(result)
                state.ended_at = max(state.ended_at, time.perf_counter())

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="load")
    futures = {pool.submit(worker) for _ in range(min(concurrency, count))}
    try:
        while futures:
            done, futures = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    results = sorted(state.results, key=lambda r: r.seq or 0)
    return results, max(0.0, (state.ended_at or time.perf_counter()) - started), state.stopped_by_time


def _side(backend: Any, cases: list[ProbeCase], concurrency: int, count: int, seconds: float,
          serial: threading.Lock | None) -> LoadSide:
    """Run one side of a level and summarise it (with a /metrics delta over the level when the
    requests carry no acceptance of their own)."""
    scrape = getattr(backend, "_scrape_metrics", None) if getattr(backend, "metrics_prefix", None) else None
    before = scrape() if scrape is not None else None
    results, wall, by_time = run_level(backend, cases, concurrency, count, seconds, serial)
    side = summarise(results, wall, stopped_by_time=by_time)
    if before is not None and side.mean_acceptance is None:
        after = scrape()
        delta = after.delta(before) if after is not None and after.prefix == before.prefix else None
        if delta is not None and delta.mean_acceptance_length is not None:
            side.mean_acceptance = round(delta.mean_acceptance_length, 4)
            side.acceptance_source = delta.source
            side.draft_tokens = delta.draft_tokens
    return side


# ---------------------------------------------------------------------------------------------
# The sweep


def single_worker(backend: Any) -> str | None:
    """Why the target serves one request at a time, when it says so: the in-process engine, or a
    server whose /health reports one worker (``ddtree-diag serve``). None otherwise."""
    from ddtree_diag.backends import TRANSPORT_IN_PROCESS

    if backend.transport_kind == TRANSPORT_IN_PROCESS:
        return "the in-process engine runs one generation at a time"
    get, base = getattr(backend, "_get", None), getattr(backend, "base_url", None)
    if get is None or base is None:
        return None
    try:
        response, data = get(f"{base}/health")
        from ddtree_diag import jsonsafe

        health = jsonsafe.loads(data, what="/health") if response.status_code == 200 else None
    except Exception:  # a server without /health, or an unreadable one: no evidence either way
        return None
    if not isinstance(health, dict):
        return None
    if health.get("workers") == 1 or {"tree_budget_default", "limits", "capabilities"} <= set(health):
        return "its /health reports one engine worker (ddtree-diag serve)"
    return None


def run_sweep(report: RunReport, backend: Any, baseline: Any, plan: Any, load: LoadPlan, cases: list[ProbeCase],
              on_stage: OnStage | None = None) -> list[str]:
    """Run every level into ``report.load`` (a level is appended when both its sides ran, so an
    interrupted sweep keeps the levels it finished); returns notes for the report. ``baseline``:
    the lossless.BaselineSpec or None (the speculative side alone); ``plan``: the RunPlan (the
    baseline server's request settings, the deployment's weights)."""
    from ddtree_diag.backends import TRANSPORT_IN_PROCESS, HttpTarget, make_backend
    from ddtree_diag.checks import lossless

    notes: list[str] = []
    speculative = [c for c in cases if c.tree_budget != 0]
    if not speculative:
        return ["load sweep skipped: no case decodes with speculation (every tree_budget is 0)"]
    where, base_backend, why_unknown = None, None, None
    if baseline is None:
        why_unknown = "no baseline: pass --baseline budget0 (or url:URL) for the speed-up"
    elif baseline.mode == "engine" and isinstance(plan.target, HttpTarget):
        why_unknown = ("--baseline engine runs the target on this machine, not on the server's hardware: "
                       "use --baseline budget0 or url:URL for the speed-up")
    else:
        where = backend.baseline_target(baseline.mode, baseline.url, http=plan.request_settings,
                                        weights=plan.local_weights)
    own_baseline = False
    if baseline is not None and why_unknown is None:
        if where is None or baseline.mode == "budget0":
            base_backend = backend  # the same server or engine, asked for tree_budget 0
        else:
            shared = backend.shared_transport() if isinstance(where, HttpTarget) else None
            if isinstance(where, HttpTarget):  # streamed like the speculative side, for TTFT and ITL
                where = where.replace(stream=plan.request_settings.stream)
            base_backend, own_baseline = make_backend(where, transport=shared), True
    base_cases = [lossless.baseline_case(c, baseline, logprobs=False) for c in speculative] if base_backend else []
    touched = [b for b in {id(backend): backend, id(base_backend): base_backend}.values() if b is not None]
    saved = [(b, getattr(b, "concurrency", None), getattr(b, "keep_chunk_times", False)) for b in touched]
    queue_reason = single_worker(backend)
    try:
        if own_baseline:
            notes.extend(f"load sweep baseline {n}" for n in base_backend.prepare(base_cases))
        for b in touched:
            b.keep_chunk_times = True
            if getattr(b, "concurrency", None) is not None:
                b.concurrency = max(2, *load.levels)  # per-request /metrics deltas mean nothing here
        # the engine cannot run two generations at once: its requests take turns, as in serve
        serial = threading.Lock() if backend.transport_kind == TRANSPORT_IN_PROCESS else None
        for n in load.levels:
            count = load.request_count(n, len(speculative))
            if on_stage is not None:
                on_stage(f"load sweep: concurrency {n}, {count} requests with speculation"
                         + (" and without" if base_backend else ""))
            level = LoadLevel(concurrency=n, speculative=_side(backend, speculative, n, count, load.seconds, serial))
            if base_backend is not None:
                level.baseline = _side(base_backend, base_cases, n, count, load.seconds, serial)
                level.baseline_source = baseline.describe()
                level.speedup = speedup(level.speculative, level.baseline)
                if level.speedup is None:
                    level.note = "speed-up unknown: a side has no aggregate tok/s (every request failed?)"
            else:
                level.note = f"speed-up unknown: {why_unknown}"
            report.load.append(level)
    finally:
        for b, concurrency, keep in saved:
            b.keep_chunk_times = keep
            if concurrency is not None:
                b.concurrency = concurrency
        if own_baseline:
            base_backend.close()
    notes.append(f"load sweep: {load.describe()}; speculative cases only, "
                 "ITL = gap between streamed chunks / the tokens each carried")
    if why_unknown:
        notes.append(f"load sweep: {why_unknown}")
    if isinstance(plan.target, HttpTarget) and not plan.target.stream:
        notes.append("load sweep: --no-stream: TTFT and ITL unknown (they need streamed answers)")
    evidence = queue_reason or queueing(report.load)
    if evidence and any(n > 1 for n in load.levels):
        notes.append(f"load sweep: the target serves one request at a time ({evidence}): the numbers at "
                     "concurrency > 1 measure a single worker's queue, not speculation's cost")
    return notes
