"""Cost of ``--via``: agent start-up, pipe round trip, and per-request overhead against direct httpx.

Uses a local prefix (``sh -c 'exec "$@"' sh``) against the stand-in server on loopback, so the
figures are the tool's own overhead (JSON lines, base64, threads), not a network's. Over ssh, add
the link's round trip per request. Run: make bench-via
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.support.processes import start_standin  # noqa: E402

PREFIX = "sh -c 'exec \"$@\"' sh"


def per_request(backend, case, runs: int) -> tuple[list[float], list[float]]:
    e2e, ttft = [], []
    for _ in range(runs):
        result = backend.run(case)
        assert result.ok, result.error
        e2e.append(result.timings.e2e_s)
        ttft.append(result.timings.ttft_s)
    return e2e, ttft


def main(runs: int = 40) -> None:
    from ddtree_diag.backends.http import HttpBackend
    from ddtree_diag.backends.via import AgentTransport
    from ddtree_diag.records import ProbeCase

    server = start_standin("--dialect", "ddtree")
    try:
        case = ProbeCase(prompt_id="bench", messages=[{"role": "user", "content": "Say hi."}], max_tokens=48)
        direct = HttpBackend(server.url, dialect="ddtree", model="standin-model")
        transport = AgentTransport(PREFIX)
        started = time.perf_counter()
        transport.start()
        start_s = time.perf_counter() - started
        via = HttpBackend(server.url, dialect="ddtree", model="standin-model", transport=transport)
        per_request(direct, case, 3)  # warm both paths
        per_request(via, case, 3)
        direct_e2e, direct_ttft = per_request(direct, case, runs)
        via_e2e, via_ttft = per_request(via, case, runs)
        direct.close()
        via.close()
    finally:
        server.process.terminate()
        server.process.wait(timeout=10)

    def ms(values: list[float]) -> str:
        return f"median {statistics.median(values) * 1000:6.2f} ms"

    print(f"agent start (spawn, send agent, hello, 3 pings): {start_s * 1000:.1f} ms")
    print(f"pipe round trip (best of 3):                     {transport.pipe_round_trip_s * 1000:.3f} ms")
    print(f"streamed request e2e, direct:  {ms(direct_e2e)}   TTFT {ms(direct_ttft)}")
    print(f"streamed request e2e, --via:   {ms(via_e2e)}   TTFT {ms(via_ttft)}")
    overhead = statistics.median(via_e2e) - statistics.median(direct_e2e)
    print(f"--via overhead per request:    {overhead * 1000:+.2f} ms (goal <= 5 ms on a local pipe)")


if __name__ == "__main__":
    main()
