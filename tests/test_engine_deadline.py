"""``--timeout`` with ``--engine``: each case's generation has a deadline, checked between decode
rounds; a case past it stops after the round in flight, keeps its text and is ``timeout``.

Tiny random-weight models on CPU (tests/support/engine_fixtures.py). The decoder's clock is replaced by
one the test moves, so no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.backends import EngineTarget, make_backend  # noqa: E402
from ddtree_diag.engine import decode, load_engine  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from ddtree_diag.records import ProbeCase  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]
PROMPT = [257, 84, 82, 68]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deadline")
    return fx.make_target(root / "target"), fx.make_draft(root / "draft", block_size=4)


@pytest.fixture(scope="module")
def engine(models):
    return load_engine(*models, device="cpu", dtype="fp32")


class Clock:
    """Stands in for the ``time`` module inside decode.py: perf_counter() is what the test says."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("path", ["eager", "fast"])
@pytest.mark.parametrize("mode", ["ar", "tree"])
def test_the_deadline_stops_generation_after_the_round_in_flight(engine, monkeypatch, path, mode):
    clock = Clock()
    monkeypatch.setattr(decode, "time", clock)
    engine.use_path(path)
    calls: list[int] = []

    def on_token(ids, text):
        calls.append(len(ids))
        if len(calls) == 3:  # the prefill's token, then two rounds: time runs out here
            clock.now = 11.0
        return True

    full = engine.generate(prompt_ids=PROMPT, tree_budget=8, max_tokens=40, mode=mode)
    gen = engine.generate(prompt_ids=PROMPT, tree_budget=8, max_tokens=40, mode=mode, on_token=on_token,
                          deadline=10.0)
    assert full.finish_reason == "length", "without a deadline the answer runs to max_tokens"
    assert gen.finish_reason == "timeout" and len(calls) == 3 and gen.decode_rounds == 2
    assert gen.token_ids == full.token_ids[: gen.completion_tokens], "what was kept is the same answer's start"
    assert gen.completion_tokens == sum(calls) < 40
    nothing = engine.generate(prompt_ids=PROMPT, tree_budget=8, max_tokens=40, mode=mode, deadline=11.0)
    assert nothing.finish_reason == "timeout" and nothing.completion_tokens == 1, "past it at the prefill already"
    engine.use_path("eager")


def test_backend_marks_a_case_past_the_timeout(models, monkeypatch):
    case = ProbeCase("p", [{"role": "user", "content": "Say hello."}], enable_thinking=False, tree_budget=8,
                     max_tokens=40)
    backend = make_backend(EngineTarget(target=str(models[0]), draft=str(models[1]), device="cpu",
                                        dtype="fp32", timeout=30))
    backend.prepare([case])
    assert backend.run(case).status == "ok"
    clock = Clock()
    monkeypatch.setattr(decode, "time", clock)
    monkeypatch.setattr("ddtree_diag.backends.engine.time", clock)  # the case's deadline: 0 + 30 s

    def late(ids, text):
        clock.now = 31.0  # every round takes "31 s": the first one is already past the deadline
        return True

    original = backend.engine.generate
    monkeypatch.setattr(backend.engine, "generate", lambda **kw: original(**kw, on_token=late))
    result = backend.run(case)
    assert result.status == "timeout" and result.finish_reason is None
    assert result.error == "generation ran past 30 s (--timeout): stopped after 1 tokens, 0 decode rounds"
    assert result.completion_tokens == 1 and result.extras["token_ids"], "the text so far is kept"
    backend.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_a_bad_timeout_is_a_usage_error_before_the_model_loads(bad):
    with pytest.raises(UsageError, match="--timeout"):
        make_backend(EngineTarget(target="/nonexistent", timeout=bad))


@pytest.mark.e2e
def test_cli_engine_case_past_the_timeout_is_a_timeout(models, cli):
    result = cli("probe", "--engine", "--target", str(models[0]), "--draft", str(models[1]), "--device", "cpu",
                 "--dtype", "fp32", "--thinking", "off", "--budget", "0,8", "--max-tokens", "32",
                 "--timeout", "0.000001", "--json", "-", timeout=600)
    assert result.code == 3, result.stderr  # a case past --timeout: as over HTTP
    records = result.json()["results"]
    assert records and all(r["status"] == "timeout" and "(--timeout)" in r["error"] for r in records)
