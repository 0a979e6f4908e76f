"""Every wall-clock figure a test relies on, and the fuzz suites' sizes, in one place.

No test may pass or fail with the machine's speed or load (3 test workers on 2 busy cores run
everything several times slower than an idle box). Tests that read a clock are marked
``timing`` and take their bounds from here. Two kinds:

- A fault that is slow *by construction* (a stand-in that sleeps per token, a delayed first
  token) must fail a threshold: the sleep is a floor under what is measured, so the threshold
  sits below the sleep-made figure and load can only make the failure surer.
- A healthy run must pass a threshold, or a deadline must cut a request in time: load only adds
  time, so these bounds sit an order of magnitude beyond the nominal figure. They still catch
  what they are for: a missing deadline waits for a server that drips for minutes.
"""

from __future__ import annotations

import os

# How far past its deadline a cut request may end (nominal: a few ms past it).
DEADLINE_SLACK_S = 10.0
# A whole CLI run against a misbehaving server, start-up included, beyond its own deadlines.
RUN_SLACK_S = 30.0
# Gate thresholds a healthy stand-in must pass: it decodes at ~500 tok/s with a TTFT of ~ms.
HEALTHY_MIN_TOKENS_PER_SECOND = 5
HEALTHY_MAX_TTFT_S = 30.0
# A stand-in made slow for the speed check: 0.04 s a token caps it at 25 tok/s on any machine.
SLOW_SECONDS_PER_TOKEN = 0.04
SLOW_MIN_TOKENS_PER_SECOND = 50
# gate --against: a known-good saved at 10× what the slow stand-in can reach must fail a slow run,
# and a healthy run judged against its own saved report is allowed any tok/s drop: a stand-in's
# few-token cases measure client tok/s over a millisecond or so, which the machine's load alone
# moves by more than 10× (a CI run saw 8,896 → 619 tok/s). Its speed check is the slow run's.
AGAINST_FAST_TOKENS_PER_SECOND = 10 / SLOW_SECONDS_PER_TOKEN
AGAINST_SELF_TPS_TOLERANCE = 1.0
# Building a 32k-token long-context prompt (filler text sized with a fake tokenizer): ~0.1 s.
FILL_32K_MAX_S = 20.0
# The load sweep's stand-in (tests/test_load_sweep.py): a speculative token takes 0.01 s, a budget-0
# one 3× that (AR_SLOWDOWN), a speculative one under --slow-spec-under-load 9× (UNDER_LOAD_SLOWDOWN
# × AR_SLOWDOWN). Sleeps are floors: a healthy level's speed-up (~3) only falls under 0.95 when one
# side alone stalls for over half a second, and the slow level's (~0.3) only passes 0.95 when the
# baseline alone stalls for over a second.
LOAD_SECONDS_PER_TOKEN = 0.01
# A healthy stand-in's ITL p99 is ~10 ms per token; the slow one's at least 90 ms under load.
HEALTHY_MAX_ITL_P99_MS = 1000.0
SLOW_MAX_ITL_P99_MS = 60.0


def fuzz_examples(base: int) -> int:
    """A fuzz test's example count: ``base`` in the suite, times ``FUZZ_SCALE`` (``make fuzz``: 4)."""
    return max(1, round(base * float(os.environ.get("FUZZ_SCALE", "1"))))
