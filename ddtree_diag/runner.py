"""Run a list of cases through a backend and collect a RunReport.

Serial by default (clean per-request numbers, and server-wide counter deltas stay attributable);
``concurrency > 1`` runs cases on a thread pool and still reports them in matrix order.
Ctrl-C stops the run and marks the report interrupted; whatever finished is kept.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ddtree_diag import __version__
from ddtree_diag.backends import Backend
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_cases(
    backend: Backend,
    cases: list[ProbeCase],
    report: RunReport,
    *,
    concurrency: int = 1,
    on_result: Callable[[ProbeResult], None] | None = None,
) -> RunReport:
    """Fill ``report.results`` in matrix order. KeyboardInterrupt propagates after the report is
    marked interrupted, so the caller can still write it."""
    report.tool_version = __version__
    report.started_at = report.started_at or _now()

    from ddtree_diag.quality import assess_result

    def finished(result: ProbeResult) -> None:
        assess_result(result)
        if on_result is not None:
            on_result(result)

    try:
        if concurrency <= 1:
            for case in cases:
                result = backend.run(case)
                finished(result)
                report.results.append(result)
        else:
            _run_pool(backend, cases, report, concurrency, finished)
    except KeyboardInterrupt:
        report.interrupted = True
        raise
    finally:
        report.finished_at = _now()
    return report


def _run_pool(backend, cases, report, concurrency, finished) -> None:
    order = {id(case): index for index, case in enumerate(cases)}
    done: list[ProbeResult] = []
    pool = ThreadPoolExecutor(max_workers=concurrency)
    pending: set[Future] = set()
    try:
        pending = {pool.submit(backend.run, case) for case in cases}
        while pending:
            completed, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in completed:
                result = future.result()
                finished(result)
                done.append(result)
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        done.sort(key=lambda r: order[id(r.case)])
        report.results.extend(done)
