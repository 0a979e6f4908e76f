"""The backends' targets and capabilities: where each backend's lossless baseline runs, what it
says about budgets and transport, and the tree-budget rules (``ddtree_diag.budget``). In-process:
no request is sent."""

from __future__ import annotations

import httpx
import pytest

from ddtree_diag import budget
from ddtree_diag.backends import (
    TRANSPORT_HTTP,
    TRANSPORT_IN_PROCESS,
    EngineTarget,
    HttpTarget,
    make_backend,
)
from ddtree_diag.backends.engine import EngineBackend
from ddtree_diag.backends.http import HttpBackend
from ddtree_diag.checks import lossless
from ddtree_diag.engine.models import EMBEDDED_MODEL_NAME
from ddtree_diag.errors import UsageError

pytestmark = pytest.mark.unit

HTTP = HttpTarget(url="http://served.invalid:8000", api_key="k", timeout=7.0, max_response_bytes=4096, stream=True,
                  concurrency=3, via="ssh gpu")
WEIGHTS = EngineTarget(target="/models/t", gguf=None, draft="/models/d", device="cpu", dtype="fp32", timeout=7.0)


def http_backend(dialect: str) -> HttpBackend:
    unused = httpx.MockTransport(lambda request: httpx.Response(500))
    return HttpBackend("http://served.invalid:8000/v1", model="m", dialect=dialect, transport=unused)


def test_a_server_backend_says_what_its_dialect_takes():
    ddtree, vllm = http_backend("ddtree"), http_backend("vllm")
    assert ddtree.sends_budget and not vllm.sends_budget
    assert vllm.dialect_name == "vllm" and "num_speculative_tokens" in vllm.budget_knob
    assert ddtree.transport_kind == TRANSPORT_HTTP and ddtree.shared_transport() is None
    assert ddtree.openai_logprobs
    assert http_backend("auto").sends_budget  # not detected yet: assumed


def test_a_server_backend_builds_each_baseline_target():
    backend = http_backend("llamacpp")
    same = backend.baseline_target("budget0", None, http=HTTP, weights=WEIGHTS)
    assert same == HttpTarget(url="http://served.invalid:8000", model="m", dialect="llamacpp", api_key="k",
                              timeout=7.0, max_response_bytes=4096, stream=False)
    other = backend.baseline_target("url", "http://plain.invalid", http=HTTP, weights=WEIGHTS)
    assert other == HttpTarget(url="http://plain.invalid", api_key="k", timeout=7.0, max_response_bytes=4096,
                               stream=False)
    alone = backend.baseline_target("engine", None, http=HTTP, weights=WEIGHTS)
    assert alone == EngineTarget(target="/models/t", device="cpu", dtype="fp32", timeout=7.0, use_draft=False)
    with pytest.raises(UsageError, match="--baseline engine needs the server's target model"):
        backend.baseline_target("engine", None, http=HTTP, weights=EngineTarget())
    backend.model = EMBEDDED_MODEL_NAME  # the server runs the embedded model: it is the baseline
    assert backend.baseline_target("engine", None, http=HTTP, weights=None) == EngineTarget(use_draft=False,
                                                                                           timeout=7.0)


def test_the_engine_backend_is_its_own_baseline_except_for_a_url():
    backend = EngineBackend("/models/t")
    assert backend.sends_budget and backend.dialect_name == "engine" and not backend.openai_logprobs
    assert backend.transport_kind == TRANSPORT_IN_PROCESS and backend.shared_transport() is None
    assert backend.baseline_target("budget0", None, http=HTTP, weights=WEIGHTS) is None
    assert backend.baseline_target("engine", None, http=HTTP, weights=WEIGHTS) is None
    assert backend.baseline_target("url", "http://plain.invalid", http=HTTP, weights=WEIGHTS).url == (
        "http://plain.invalid")


def test_budget0_is_refused_for_a_server_that_takes_no_budget():
    spec = lossless.parse_baseline("budget0")
    lossless.check_possible(spec, http_backend("ddtree"))
    lossless.check_possible(spec, EngineBackend("/models/t"))
    with pytest.raises(UsageError, match=r"sglang does not \(--speculative-num-draft-tokens at server start\)"):
        lossless.check_possible(spec, http_backend("sglang"))


@pytest.mark.parametrize("target, http, needle", [
    (EngineTarget(), HttpTarget(url="http://x.invalid"), "give either --url or --engine, not both"),
    (EngineTarget(), HttpTarget(via="env"), "--via works with --url only"),
    (EngineTarget(timeout=0), None, "--timeout"),
    (EngineTarget(concurrency=0), HttpTarget(url="http://x.invalid"), "--concurrency must be >= 1"),
    (HttpTarget(), None, "no target: give --url"),
])
def test_make_backend_refuses_a_target_that_cannot_run(target, http, needle):
    with pytest.raises(UsageError, match=needle):
        make_backend(target, http=http)


def test_budget_rules():
    assert budget.resolve(None, 64) == 64 and budget.resolve(0, 64) == 0
    assert budget.server_default(64, 16) == 16
    assert budget.over_limit(17, 16) == "tree_budget 17 exceeds this server's limit 16 (serve --max-tree-budget)"
    assert budget.over_limit(None, 0) is None and budget.over_limit(16, 16) is None
    budget.check_serve_flags(16, budget.MAX_TREE_BUDGET)
    for default, limit, needle in [(-1, None, "--tree-budget must be >= 0"),
                                   (None, budget.MAX_TREE_BUDGET + 1, "--max-tree-budget must be in 0-4096"),
                                   (32, 16, "--tree-budget 32 is over --max-tree-budget 16")]:
        with pytest.raises(UsageError, match=needle):
            budget.check_serve_flags(default, limit)
    with pytest.raises(UsageError, match=r"over the limit 256 \(--max-tree-budget\)"):
        budget.check_default_within(300, 256)
    assert lossless.baseline_case(_case(), lossless.parse_baseline("engine"), logprobs=False).tree_budget == (
        budget.AR_BUDGET)


def _case():
    from ddtree_diag.records import ProbeCase

    return ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}], tree_budget=16)
