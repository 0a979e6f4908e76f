"""Scale of a fleet run: ``ddtree-diag probe --targets FILE --matrix smoke --parallel P`` against
hundreds of identical STAND-IN replicas (tests/support/standin_server.py ``--replicas N``: one
process, N loopback ports), as a real subprocess.

Prints, per run: wall time; each target's own time (the sum of its cases' e2e: its cases run one
after another; its setup, the model list and dialect check, is not in it); the ideal wall time
(ceil(targets / parallel) waves of the median target, or the slowest target when every target
runs at once) and wall / ideal; the child's CPU time per target, peak RSS (``wait4``), peak
threads and open files (sampled from /proc); the exit code. Then the RSS growth per target
between two sizes at the same --parallel, against the JSON report's size per target: memory
that is bounded grows with the report only. Asserts nothing about time.

    python -m bench.bench_fleet                         # 1x1, 100x100, 100x8, 1000x100 (TARGETSxPARALLEL)
    python -m bench.bench_fleet --runs 100x100,1000x64 --seconds-per-token 0.002
    python -m bench.bench_fleet --cli "env PYTHONPATH=/other/checkout .venv/bin/python -P -m ddtree_diag"

Every run shares one stand-in (as many replicas as the largest run has targets). The CLI and the
stand-in share the machine's cores: with few cores a wide fleet is CPU-bound (see the CLI's and
the stand-in's CPU a target), and wall / ideal above 1 says how much. Run: make bench-fleet
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.support.processes import STANDIN  # noqa: E402

DEFAULT_RUNS = "1x1,100x100,100x8,1000x100"


@dataclass
class Figures:
    targets: int
    parallel: int
    wall_s: float = 0.0
    exit_code: int | None = None
    target_s: list[float] = field(default_factory=list)  # each target's sum of e2e
    ok_cases: int = 0
    cases: int = 0
    target_exits: dict[int | None, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # the child's user + system time
    server_cpu_s: float = 0.0  # the stand-in's, during the run (it shares the cores)
    peak_rss_mb: float = 0.0
    peak_threads: int = 0
    peak_fds: int = 0
    report_bytes: int = 0
    tail: str = ""

    @property
    def slowest_s(self) -> float:
        return max(self.target_s, default=0.0)

    @property
    def median_s(self) -> float:
        return statistics.median(self.target_s) if self.target_s else 0.0

    @property
    def ideal_s(self) -> float:
        """Perfect scheduling: every target at once (the slowest sets the pace), else waves of
        ``parallel`` median targets."""
        if self.parallel >= self.targets:
            return self.slowest_s
        return math.ceil(self.targets / self.parallel) * self.median_s


def raise_fd_limit(wanted: int) -> tuple[int, int]:
    """The soft open-files limit up to ``wanted`` (never past the hard one); children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def start_replicas(count: int, seconds_per_token: float) -> tuple[subprocess.Popen, list[int]]:
    process = subprocess.Popen(
        [sys.executable, str(STANDIN), "--dialect", "ddtree", "--replicas", str(count),
         "--seconds-per-token", str(seconds_per_token)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,  # clients closing early: noise
    )
    line = process.stdout.readline()
    if not line.startswith("PORTS "):
        process.kill()
        raise RuntimeError(f"stand-in replicas did not start: {line!r}")
    ports = [int(p) for p in line.split()[1:]]
    assert len(ports) == count
    return process, ports


def targets_file(directory: Path, ports: list[int]) -> Path:
    """One [[target]] with a pattern variable: ``ports`` fills {port}, one target per port."""
    path = directory / f"fleet-{len(ports)}.toml"
    path.write_text(
        "[defaults]\n"
        'dialect = "ddtree"\n\n'
        "[[target]]\n"
        'name = "r-{port}"\n'
        'url = "http://127.0.0.1:{port}"\n'
        f"ports = [{', '.join(map(str, ports))}]\n",
        encoding="utf-8",
    )
    return path


def cli_command(given: str | None = None) -> list[str]:
    if given:
        return shlex.split(given)
    exe = Path(sys.executable).with_name("ddtree-diag")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ddtree_diag"]


class Sampler(threading.Thread):
    """Peak threads and open files of a running process, from /proc (Linux; zeros elsewhere)."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.threads = self.fds = 0
        self.stop = threading.Event()

    def run(self) -> None:
        proc = Path(f"/proc/{self.pid}")
        while not self.stop.is_set():
            try:
                status = (proc / "status").read_text()
                threads = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
                self.threads = max(self.threads, threads)
                self.fds = max(self.fds, len(os.listdir(proc / "fd")))
            except (OSError, StopIteration, ValueError):
                pass  # gone, or not Linux
            self.stop.wait(self.every)


def run_fleet(targets_path: Path, parallel: int, out: Path, figures: Figures, timeout: float,
              cli: str | None = None) -> None:
    command = [*cli_command(cli), "probe", "--targets", str(targets_path), "--matrix", "smoke",
               "--parallel", str(parallel), "--json", str(out), "--quiet"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_DIAG_", "OPENAI_"))}
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(child.pid)
        sampler.start()
        deadline = started + timeout
        while True:  # wait4: this child's own rusage (RUSAGE_CHILDREN would be a max over every run)
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                pid, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.01)
        figures.wall_s = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
        child.returncode = figures.exit_code = os.waitstatus_to_exitcode(status)
        figures.cpu_s = usage.ru_utime + usage.ru_stime
        figures.peak_rss_mb = usage.ru_maxrss / 1024  # KiB on Linux
        figures.peak_threads, figures.peak_fds = sampler.threads, sampler.fds
        log.seek(0)
        figures.tail = log.read()[-1500:]


def read_report(out: Path, figures: Figures) -> None:
    if not out.exists():
        return
    figures.report_bytes = out.stat().st_size
    report = json.loads(out.read_text(encoding="utf-8"))
    for member in report.get("targets", []):
        results = member["report"].get("results", [])
        figures.target_s.append(sum(r["timings"]["e2e_s"] or 0.0 for r in results))
        figures.cases += len(results)
        figures.ok_cases += sum(1 for r in results if r.get("status") == "ok")
        code = member.get("exit_code")
        figures.target_exits[code] = figures.target_exits.get(code, 0) + 1


def prepare_cost(targets_path: Path, count: int) -> float | None:
    """Seconds ``fleet.prepare`` takes in process for ``count`` targets (every target's matrix,
    baseline and gate resolved before any request)."""
    try:
        from ddtree_diag import fleet
        from ddtree_diag.commands.options import RunFlags
        from ddtree_diag.commands.run import fleet_specs, plan_from
    except ImportError:
        return None
    flags = RunFlags(targets=str(targets_path))
    specs = fleet_specs(flags)
    assert len(specs) == count
    started = time.perf_counter()
    fleet.prepare(specs, lambda spec: plan_from(flags, "smoke", gate=False, spec=spec), gate=False)  # type: ignore[arg-type,return-value]
    return time.perf_counter() - started


def parse_runs(text: str) -> list[tuple[int, int]]:
    runs = []
    for item in text.split(","):
        targets, _, parallel = item.strip().lower().partition("x")
        runs.append((int(targets), int(parallel or 8)))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS,
                        help=f"TARGETSxPARALLEL,... (default {DEFAULT_RUNS}; the CLI's default --parallel is 8)")
    parser.add_argument("--seconds-per-token", type=float, default=0.001, help="the stand-in's decode speed")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run before it is killed")
    parser.add_argument("--cli", default=None,
                        help="the command to run instead of ddtree-diag (another checkout, a .pyz, a patched build)")
    args = parser.parse_args()
    runs = parse_runs(args.runs)
    largest = max(t for t, _ in runs)
    soft, hard = raise_fd_limit(4 * largest + 1024)
    print(f"cores {os.cpu_count()}, open-files limit {soft} (hard {hard}), matrix smoke (4 cases a target), "
          f"stand-in {args.seconds_per_token * 1000:g} ms/token")
    started = time.perf_counter()
    standin, ports = start_replicas(largest, args.seconds_per_token)
    print(f"stand-in: {largest} replicas in one process, ready in {time.perf_counter() - started:.2f} s")
    done: list[Figures] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            prep = prepare_cost(targets_file(directory, ports), largest)
            if prep is not None:
                print(f"fleet.prepare in process, {largest} targets: {prep * 1000:.0f} ms "
                      f"({prep / largest * 1000:.2f} ms a target)")
            header = (f"{'targets':>7} {'par':>4} {'wall s':>7} {'slowest':>7} {'median':>7} {'ideal':>6} "
                      f"{'wall/ideal':>10} {'cpu ms/t':>8} {'srv ms/t':>8} {'rss MB':>7} {'threads':>7} {'fds':>5} "
                      f"{'ok cases':>10} {'exit':>4}")
            print(header)
            for count, parallel in runs:
                figures = Figures(count, parallel)
                out = directory / f"fleet-{count}x{parallel}.json"
                server_before = _cpu_s(standin.pid)
                run_fleet(targets_file(directory, ports[:count]), parallel, out, figures, args.timeout, args.cli)
                figures.server_cpu_s = _cpu_s(standin.pid) - server_before
                read_report(out, figures)
                ratio = figures.wall_s / figures.ideal_s if figures.ideal_s else float("nan")
                print(f"{count:>7} {parallel:>4} {figures.wall_s:>7.2f} {figures.slowest_s:>7.3f} "
                      f"{figures.median_s:>7.3f} {figures.ideal_s:>6.2f} {ratio:>10.2f} "
                      f"{figures.cpu_s / count * 1000:>8.1f} {figures.server_cpu_s / count * 1000:>8.1f} "
                      f"{figures.peak_rss_mb:>7.1f} {figures.peak_threads:>7} "
                      f"{figures.peak_fds:>5} {figures.ok_cases:>4}/{figures.cases:<5} {figures.exit_code:>4}",
                      flush=True)
                if figures.exit_code != 0 or figures.ok_cases != figures.cases or len(figures.target_s) != count:
                    exits = ", ".join(f"{k}: {v}" for k, v in sorted(figures.target_exits.items(), key=str))
                    print(f"        targets reported {len(figures.target_s)} of {count}; their exit codes {{{exits}}}; "
                          "the CLI's last output:\n        " + figures.tail.strip().replace("\n", "\n        "))
                done.append(figures)
    finally:
        standin_rss = _rss_mb(standin.pid)
        standin.terminate()
        standin.wait(timeout=30)
    if standin_rss:
        print(f"stand-in RSS at the end: {standin_rss:.0f} MB ({largest} replicas, every request logged)")
    print("wall/ideal: 1.0 = perfect overlap; ideal = the slowest target when all run at once, else "
          "ceil(targets/parallel) x the median target (setup per target not counted)")
    _growth(done)


def _growth(done: list[Figures]) -> None:
    """RSS per extra target between the smallest and largest run at one --parallel."""
    by_parallel: dict[int, list[Figures]] = {}
    for figures in done:
        if figures.exit_code is not None and figures.report_bytes:
            by_parallel.setdefault(figures.parallel, []).append(figures)
    for parallel, group in sorted(by_parallel.items()):
        small, large = min(group, key=lambda f: f.targets), max(group, key=lambda f: f.targets)
        if large.targets == small.targets:
            continue
        extra = large.targets - small.targets
        rss_kb = (large.peak_rss_mb - small.peak_rss_mb) * 1024 / extra
        report_kb = (large.report_bytes - small.report_bytes) / 1024 / extra
        print(f"--parallel {parallel}: {small.targets} -> {large.targets} targets: peak RSS "
              f"{small.peak_rss_mb:.0f} -> {large.peak_rss_mb:.0f} MB, {rss_kb:+.1f} KB a target; the JSON "
              f"report {report_kb:.1f} KB a target; peak threads {small.peak_threads} -> {large.peak_threads}, "
              f"open files {small.peak_fds} -> {large.peak_fds}")


def _cpu_s(pid: int) -> float:
    """User + system seconds of a running process (/proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return int(line.split()[1]) / 1024 if line else None


if __name__ == "__main__":
    main()
