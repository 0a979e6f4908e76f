"""Calibration figures for the target-likelihood check (checks/likelihood.py, ``--score-with``).

Scores the labelled corpus (tests/data/quality/) and generated garbage classes
(tests/support/quality_gen.py) with a model and prints, per group, the mean surprisal (nats/token) and
the worst 16-token span at the usual quantiles, then how many texts the thresholds flag (soft,
hard) and the scoring speed. Needs the engine extra (and the embedded model for the default).

    python -m bench.bench_likelihood [--model embedded] [--limit 120] [--seeds 10]

Slow on CPU (one forward per answer: ~0.1-2 s each on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ddtree_diag.checks.likelihood import MEAN_HARD, MEAN_SOFT, SPAN_HARD, Scorer, likelihood_reasons
from tests.support import quality_gen

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "quality"
QUANTILES = (0.0, 0.5, 0.9, 0.95, 1.0)


def _row(name: str, scores: list) -> None:
    if not scores:
        return
    means = sorted(s.mean_surprisal for s in scores)
    spans = sorted(s.worst_span_surprisal for s in scores)

    def q(values: list[float]) -> str:
        return " ".join(f"{values[round(p * (len(values) - 1))]:5.2f}" for p in QUANTILES)

    flagged = [max((r.weight for r in likelihood_reasons(s, greedy=False)), default=0) for s in scores]
    soft = sum(0 < w < 0.5 for w in flagged)
    hard = sum(w >= 0.5 for w in flagged)
    print(f"{name:34} {len(scores):4}  mean {q(means)}  span {q(spans)}  soft {soft:3} hard {hard:3}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--limit", type=int, default=120, help="corpus texts per label")
    parser.add_argument("--seeds", type=int, default=10, help="generated texts per class")
    args = parser.parse_args()
    scorer = Scorer.load(args.model)
    print(f"model {scorer.name}; thresholds: soft mean >= {MEAN_SOFT}, hard mean >= {MEAN_HARD} or span >= {SPAN_HARD}")
    print(f"{'group':34} {'n':>4}  {'mean surprisal min/50/90/95/max':35}  {'worst span':35}")
    rows = [json.loads(line) for path in sorted(CORPUS.glob("*.jsonl")) for line in path.open(encoding="utf-8")]
    started, count = time.perf_counter(), 0
    for label in ("clean", "garbage"):
        picked = [r for r in rows if r["label"] == label and len(r["text"]) > 20][: args.limit]
        scores = [scorer.score(r["text"], [{"role": "user", "content": r["prompt"]}],
                               stopped=r.get("finish_reason") == "stop") for r in picked]
        count += len(scores)
        _row(f"corpus {label} (4+ tokens)", [s for s in scores if s.tokens >= 4])
    for klass in ("salad", "salad after opening", "salad after code", "glued/split words", "doubled words"):
        samples = [quality_gen.generate(klass, seed) for seed in range(args.seeds)]
        scores = [scorer.score(s.text, [{"role": "user", "content": s.prompt}]) for s in samples]
        count += len(scores)
        _row(f"gen {klass}", scores)
    elapsed = time.perf_counter() - started
    print(f"\n{count} answers scored in {elapsed:.0f} s ({elapsed / max(1, count):.2f} s each)")


if __name__ == "__main__":
    main()
