"""The BLAS library of the fast path's draft and verify stages: chosen per stage shape by timing
each library's captured replay (bf16 / fp16), fixed by DDTREE_DIAG_BLAS, never switched in fp32.

CUDA graphs need a GPU, so here a stand-in for ``graphs.Stage`` runs each stage eagerly (as the CPU
path does), records what the decoder asked of it, and reports scripted replay times where it was
asked to choose; the decoder's side (which stages choose, that a shape chooses once for all its
attention windows, what the request reports) is the real code.
"""

from __future__ import annotations

import contextlib
import json
from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import decoder as fast_decoder  # noqa: E402
from ddtree_diag.engine.fast import graphs  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize(
    ("times", "kept"),
    [
        ({"cublas": 10.0, "cublaslt": 9.0}, "cublaslt"),
        ({"cublas": 9.0, "cublaslt": 10.0}, "cublas"),
        ({"cublas": 10.0, "cublaslt": 9.99}, "cublas"),  # inside the margin: noise, the default stays
        ({"cublas": 10.0, "cublaslt": 10.0 * (1 - graphs.BLAS_MARGIN) - 0.01}, "cublaslt"),
    ],
)
def test_the_faster_library_is_kept_past_the_margin_only(times, kept):
    assert graphs.faster_library(times) == kept


class FakePreference:
    """Stands in for ``torch.backends.cuda.preferred_blas_library``: records what was set, and
    refuses the libraries in ``refused`` as a build without them does."""

    def __init__(self, refused=()):
        self.current, self.calls, self.refused = "cublas", [], set(refused)

    def __call__(self, backend=None):
        if backend is not None:
            if backend in self.refused:
                raise RuntimeError(f"Cannot set preferred backend to {backend}")
            self.calls.append(backend)
            self.current = backend
        return self.current


def test_a_library_is_set_inside_and_the_previous_one_restored_after(monkeypatch):
    preference = FakePreference()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preference)
    with graphs.blas_library("cublaslt"):
        assert preference.current == "cublaslt"
    assert preference.current == "cublas"
    with pytest.raises(KeyError), graphs.blas_library("cublaslt"):
        raise KeyError("a failed capture")
    assert preference.current == "cublas"
    with graphs.blas_library(None):  # as it is: nothing set
        pass
    assert preference.calls == ["cublaslt", "cublas", "cublaslt", "cublas"]


@pytest.mark.parametrize(("refused", "switchable"), [((), True), (("cublaslt",), False)])
def test_a_build_that_refuses_a_library_never_chooses(monkeypatch, refused, switchable):
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", FakePreference(refused))
    graphs.blas_switchable.cache_clear()
    try:
        assert graphs.blas_switchable() is switchable
    finally:
        graphs.blas_switchable.cache_clear()


def test_torchs_one_experimental_warning_goes_nowhere_and_stderr_comes_back(capfd):
    import os

    with graphs._quiet_stderr():
        os.write(2, b"written by C++ to fd 2\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


class RecordingStage(graphs.Stage):
    """Runs eagerly; records (captured?, blas, choose_blas); where asked to choose, reports
    cuBLASLt's replay as ``LT_MS`` against cuBLAS's 10 ms."""

    LT_MS = 8.0
    LT_ERROR: str | None = None  # set: cuBLASLt's capture fails with it, cuBLAS's graph stays
    made: ClassVar[list[RecordingStage]] = []

    def __init__(self, fn, capture, pool=None, blas=None, choose_blas=False):
        super().__init__(fn, False, pool, blas=blas)
        self.asked = (capture, blas, choose_blas)
        if choose_blas and self.LT_ERROR:
            self.blas, self.blas_error = "cublas", f"under cublaslt: {self.LT_ERROR}"
        elif choose_blas:
            self.blas_ms = {"cublas": 10.0, "cublaslt": self.LT_MS}
            self.blas = graphs.faster_library(self.blas_ms)
        self.made.append(self)


@pytest.fixture
def capturing_decoder(tmp_path, monkeypatch):
    """A fast decoder that believes it captures graphs (on CPU: the stand-in stage), per dtype."""
    monkeypatch.setattr(fast_decoder, "Stage", RecordingStage)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setenv("DDTREE_DIAG_COMPILE_AHEAD", "off")
    monkeypatch.delenv("DDTREE_DIAG_BLAS", raising=False)
    monkeypatch.setattr(fast_decoder, "blas_switchable", lambda: True)  # as a CUDA build
    # a stage that is not captured runs under its library: switching one needs a CUDA build
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", FakePreference())
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "cache"))  # where measured choices are kept
    RecordingStage.made = []
    target = fx.make_target(tmp_path / "target")
    draft = fx.make_draft(tmp_path / "draft", block_size=4)

    def make(dtype: str):
        engine = load_engine(target, draft, device="cpu", dtype=dtype)
        engine._decoders["fast"] = decoder = fast_decoder.FastDecoder(engine, graphs=True)
        engine.use_path("fast")
        return engine, decoder

    return make


def decode(engine, decoder, prompt, budget=8, max_tokens=60):
    assert engine.decoder("fast") is decoder
    return engine.generate_ids(prompt_ids=prompt, tree_budget=budget, max_tokens=max_tokens, stop_token_ids=[])


def asked_by_key(decoder) -> dict[tuple, tuple]:
    return {key: stage.asked for key, stage in decoder.stages.items()}


def test_each_stage_shape_chooses_once_and_its_other_windows_follow(capturing_decoder):
    engine, decoder = capturing_decoder("bf16")
    # the context crosses a window boundary: two windows' stages in the one request
    prompt = [(7 * i) % 250 + 10 for i in range(fast_decoder.WINDOW - 40)]
    result = decode(engine, decoder, prompt)
    asked = asked_by_key(decoder)
    windows = {key[-1] for key in asked if key[0] == "verify"}
    assert windows == {fast_decoder.WINDOW, 2 * fast_decoder.WINDOW}
    for key, (captured, blas, choose) in asked.items():
        assert captured
        if key[0] in ("draft", "verify"):
            first_window = key[-1] == fast_decoder.WINDOW
            # the first window of a shape measures; the next one is captured with its choice
            assert (blas, choose) == ((None, True) if first_window else ("cublaslt", False)), key
        else:  # tree and commit: no GEMMs, nothing to choose
            assert (blas, choose) == (None, False), key
    choices = result.extras["blas_choices"]
    assert set(choices) == {"draft", "verify-9", "verify-1"}
    assert all(choice == {"chosen": "cublaslt", "cublas": 10.0, "cublaslt": 8.0} for choice in choices.values())

    # the same shapes captured again (as after the caches grow, which drops every stage): the
    # choices made stand, nothing is measured again
    decoder.stages.clear()
    RecordingStage.made = []
    decode(engine, decoder, prompt)
    # and an AR request's one-row verify (no draft features to keep): the same GEMMs as the tree
    # request's one-row last round, so that choice stands too
    ar = decode(engine, decoder, prompt, budget=0, max_tokens=8)
    assert any(key[0] == "verify" and key[1:3] == (1, False) for key in decoder.stages)
    assert RecordingStage.made and not any(stage.asked[2] for stage in RecordingStage.made)
    assert {stage.asked[1] for stage in RecordingStage.made} == {None, "cublaslt"}
    assert ar.extras["blas_choices"] == choices


def test_a_slower_alternative_keeps_cublas(capturing_decoder, monkeypatch):
    monkeypatch.setattr(RecordingStage, "LT_MS", 12.0)
    engine, decoder = capturing_decoder("bf16")
    result = decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
    assert {choice["chosen"] for choice in result.extras["blas_choices"].values()} == {"cublas"}


def test_a_measured_choice_stands_in_later_processes_on_this_machine(capturing_decoder, tmp_path, monkeypatch):
    engine, decoder = capturing_decoder("bf16")
    decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
    store = tmp_path / "cache" / "blas-choice"
    assert len(list(store.glob("*.json"))) == 3  # draft, verify at 9 rows and at 1

    def later_process():
        RecordingStage.made = []
        engine, decoder = capturing_decoder("bf16")  # a new decoder: nothing measured in memory
        return decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)

    result = later_process()
    gemm_stages = [stage for stage in RecordingStage.made if stage.asked[1] is not None or stage.asked[2]]
    assert gemm_stages and all(stage.asked[1:] == ("cublaslt", False) for stage in gemm_stages)
    stored = {"chosen": "cublaslt", "cublas": 10.0, "cublaslt": 8.0, "stored": True}
    assert result.extras["blas_choices"] == dict.fromkeys(("draft", "verify-1", "verify-9"), stored)

    # a damaged store is measured again (and rewritten); one that cannot be written is no error
    for path in store.glob("*.json"):
        path.write_text("{not json")
    later_process()
    assert sum(stage.asked[2] for stage in RecordingStage.made) == 3
    assert all(json.loads(path.read_text())["chosen"] == "cublaslt" for path in store.glob("*.json"))
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "a file"))
    assert later_process().token_ids
    assert sum(stage.asked[2] for stage in RecordingStage.made) == 3


def test_a_choice_kept_by_a_process_measuring_at_the_same_time_is_taken(capturing_decoder, monkeypatch):
    """Two first processes measure the same shapes at once: the one that keeps its choice first
    wins, and the other captures its stages again under that choice, so both run the same GEMMs."""
    engine, decoder = capturing_decoder("bf16")
    real_store = fast_decoder.FastDecoder._store_blas

    def store_after_another_process(self, shape):
        other = self.blas_choices[shape] | {"chosen": "cublas"}  # it measured cuBLAS a hair faster
        path = self._blas_file(shape)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(other))
        return real_store(self, shape)

    monkeypatch.setattr(fast_decoder.FastDecoder, "_store_blas", store_after_another_process)
    result = decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
    choices = result.extras["blas_choices"]
    assert set(choices) == {"draft", "verify-9", "verify-1"}
    assert all(choice["chosen"] == "cublas" and choice["stored"] for choice in choices.values())
    gemm_stages = {key: stage for key, stage in decoder.stages.items() if key[0] in ("draft", "verify")}
    assert gemm_stages and all(stage.asked[1:] == ("cublas", False) for stage in gemm_stages.values())
    assert sum(stage.asked[2] for stage in RecordingStage.made) == 3  # measured once a shape, then taken


def test_the_stored_choice_follows_what_changes_the_gemms(capturing_decoder, monkeypatch):
    engine, decoder = capturing_decoder("bf16")
    file = decoder._blas_file(("verify", 9))
    assert file == decoder._blas_file(("verify", 9))
    assert file != decoder._blas_file(("verify", 17)) != decoder._blas_file(("draft",))
    monkeypatch.setattr(engine.target.config, "_name_or_path", "/elsewhere/the-same-model")
    assert decoder._blas_file(("verify", 9)) == file  # the same model copied elsewhere: its kernels
    for name, value in [("DDTREE_DIAG_WEIGHT_LAYOUT", "rows"), ("CUBLASLT_WORKSPACE_SIZE", "1024")]:
        with monkeypatch.context() as switched:
            switched.setenv(name, value)
            assert decoder._blas_file(("verify", 9)) != file, name
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = not allowed  # a flag torch reads, not an attribute
    try:
        assert decoder._blas_file(("verify", 9)) != file
    finally:
        matmul.allow_bf16_reduced_precision_reduction = allowed
    other_config = capturing_decoder("fp16")[1]
    assert other_config._blas_file(("verify", 9)) != file
    # a torch that cannot switch libraries reads no stored choice
    decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
    monkeypatch.setattr(fast_decoder, "blas_switchable", lambda: False)
    fresh = capturing_decoder("bf16")[1]
    assert fresh._stored_blas(("verify", 9)) is None


def test_a_stage_that_is_not_captured_runs_under_its_library(monkeypatch):
    preference = FakePreference()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preference)
    seen = []
    stage = graphs.Stage(lambda: seen.append(preference.current), False, blas="cublaslt")
    stage.run()
    graphs.Stage(lambda: seen.append(preference.current), False).run()
    assert seen == ["cublaslt", "cublas"] and preference.current == "cublas"


def test_an_alternative_that_will_not_capture_keeps_cublas_and_says_why(capturing_decoder, monkeypatch):
    monkeypatch.setattr(RecordingStage, "LT_ERROR", "capture: operation not permitted")
    engine, decoder = capturing_decoder("bf16")
    prompt = [(7 * i) % 250 + 10 for i in range(fast_decoder.WINDOW - 40)]  # two windows
    result = decode(engine, decoder, prompt)
    choices = result.extras["blas_choices"]
    assert set(choices) == {"draft", "verify-9", "verify-1"}
    for choice in choices.values():
        assert choice == {"chosen": "cublas", "error": "under cublaslt: capture: operation not permitted"}
    # measured once: the second window's stages take the choice, they do not fail again
    assert sum(stage.asked[2] for stage in RecordingStage.made) == 3
    # a choice made without its alternative is not kept for later processes (the failure may be
    # a moment's lack of memory): the next process measures again
    RecordingStage.made = []
    monkeypatch.setattr(RecordingStage, "LT_ERROR", None)
    engine, decoder = capturing_decoder("bf16")
    later = decode(engine, decoder, fx.PROMPTS[0], max_tokens=8).extras["blas_choices"]
    assert sum(stage.asked[2] for stage in RecordingStage.made) == 3
    assert {choice["chosen"] for choice in later.values()} == {"cublaslt"}


def test_fp32_keeps_the_default_library_the_eager_path_runs(capturing_decoder):
    engine, decoder = capturing_decoder("fp32")
    result = decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
    assert result.extras["blas_choices"] == {}
    assert all(blas is None and not choose for _, blas, choose in asked_by_key(decoder).values())


@pytest.mark.parametrize("library", graphs.BLAS_LIBRARIES)
def test_the_environment_fixes_the_library_of_every_gemm_stage(capturing_decoder, monkeypatch, library):
    monkeypatch.setenv("DDTREE_DIAG_BLAS", library.upper())
    for dtype in ("bf16", "fp32"):
        engine, decoder = capturing_decoder(dtype)
        result = decode(engine, decoder, fx.PROMPTS[0], max_tokens=8)
        assert result.extras["blas_choices"] == {}
        for key, (_, blas, choose) in asked_by_key(decoder).items():
            assert blas == (library if key[0] in ("draft", "verify") else None) and not choose, key


def test_an_unknown_library_is_one_clear_error_before_the_weights_load(capturing_decoder, monkeypatch):
    monkeypatch.setenv("DDTREE_DIAG_BLAS", "mkl")
    with pytest.raises(UsageError, match="DDTREE_DIAG_BLAS='mkl': use auto, cublas or cublaslt"):
        capturing_decoder("bf16")


def test_a_fixed_library_the_build_cannot_switch_to_is_one_clear_error(capturing_decoder, monkeypatch):
    engine, _ = capturing_decoder("bf16")
    monkeypatch.setattr(fast_decoder, "blas_switchable", lambda: False)
    monkeypatch.setenv("DDTREE_DIAG_BLAS", "cublaslt")
    with pytest.raises(UsageError, match="DDTREE_DIAG_BLAS=cublaslt: this torch build cannot run its GEMMs"):
        fast_decoder.FastDecoder(engine, graphs=True)
    fast_decoder.FastDecoder(engine, graphs=False)  # nothing captured, nothing to switch: no error


class FakeGraph:
    def __init__(self, library):
        self.library = library


def choosing_stage(monkeypatch, outcomes, times=None):
    """A ``graphs.Stage`` made to choose, its captures and replay timing stood in for: ``outcomes``
    maps a library to "graph", "warm-up" (fails before capturing) or "capture" (fails capturing)."""
    tried = []

    def capture(self, pool, blas):
        tried.append(blas)
        outcome = outcomes[blas]
        if outcome == "graph":
            return FakeGraph(blas), None
        if outcome == "capture":
            self.capture_failed = True
        return None, f"{outcome}: refused under {blas}"

    monkeypatch.setattr(graphs, "blas_switchable", lambda: True)
    monkeypatch.setattr(graphs.Stage, "_capture", capture)
    monkeypatch.setattr(graphs, "_fastest_replays", lambda found, trials: {name: times[name] for name in found})
    stage = graphs.Stage(lambda: None, True, choose_blas=True)
    return stage, tried


def test_a_choosing_stage_keeps_the_faster_graph(monkeypatch):
    stage, tried = choosing_stage(monkeypatch, {"cublas": "graph", "cublaslt": "graph"},
                                  {"cublas": 10.0, "cublaslt": 9.0})
    assert tried == ["cublas", "cublaslt"]
    assert (stage.blas, stage.graph.library) == ("cublaslt", "cublaslt")
    assert stage.blas_ms == {"cublas": 10.0, "cublaslt": 9.0}
    assert stage.error is None and stage.blas_error is None and not stage.capture_failed


@pytest.mark.parametrize("failure", ["warm-up", "capture"])
def test_a_choosing_stage_keeps_cublas_where_the_alternative_fails(monkeypatch, failure):
    stage, tried = choosing_stage(monkeypatch, {"cublas": "graph", "cublaslt": failure})
    assert tried == ["cublas", "cublaslt"]
    assert (stage.blas, stage.graph.library, stage.blas_ms) == ("cublas", "cublas", {})
    assert stage.error is None  # the stage has its graph: no CUDA-graph error to report
    assert stage.blas_error == f"under cublaslt: {failure}: refused under cublaslt"
    # a failed capture may have left the shared pool recording: the decoder must stop capturing
    assert stage.capture_failed is (failure == "capture")


def test_a_stage_that_will_not_capture_under_cublas_tries_nothing_else(monkeypatch):
    stage, tried = choosing_stage(monkeypatch, {"cublas": "warm-up", "cublaslt": "graph"})
    assert tried == ["cublas"]
    assert stage.graph is None and stage.blas is None and stage.error == "warm-up: refused under cublas"


def test_the_first_switch_away_from_cublas_is_the_silenced_one(monkeypatch):
    preference = FakePreference()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preference)
    monkeypatch.setattr(graphs, "_lt_warned", False)
    silenced = []

    @contextlib.contextmanager
    def quiet():
        silenced.append(preference.current)
        yield

    monkeypatch.setattr(graphs, "_quiet_stderr", quiet)
    with graphs.blas_library("cublas"):
        pass
    assert silenced == []  # cuBLAS: torch does not warn
    with graphs.blas_library("cublaslt"):
        pass
    with graphs.blas_library("cublaslt"):
        pass
    assert silenced == ["cublas"]  # once, around the first switch (torch warns once a process)
    # a process whose default is cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1): the restore is its first switch
    monkeypatch.setattr(graphs, "_lt_warned", False)
    preference.current = "cublaslt"
    with graphs.blas_library("cublas"):
        pass
    assert silenced == ["cublas", "cublas"] and preference.current == "cublaslt"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stages_are_captured_under_each_library_and_the_choice_is_reported(tmp_path, monkeypatch):
    """On a GPU in bf16: the draft and verify stages are captured under both libraries and timed,
    the process's BLAS preference is as it was afterwards, and the tokens stay the eager path's
    up to bf16 near-ties (the two libraries may sum a GEMM in another order)."""
    from ddtree_diag.engine.divergence import first_divergence

    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "cache"))  # no choice an earlier run kept
    monkeypatch.delenv("DDTREE_DIAG_BLAS", raising=False)
    before = torch.backends.cuda.preferred_blas_library()
    target = fx.make_target(tmp_path / "target")
    engine = load_engine(target, fx.make_draft(tmp_path / "d8", block_size=8), device="cuda", dtype="bf16")
    prompt = fx.PROMPTS[1]
    engine.use_path("eager")
    eager = engine.generate_ids(prompt_ids=prompt, tree_budget=16, max_tokens=24, stop_token_ids=[])
    engine.use_path("fast")
    quick = engine.generate_ids(prompt_ids=prompt, tree_budget=16, max_tokens=24, stop_token_ids=[])
    assert quick.extras["cuda_graph_errors"] == []
    choices = quick.extras["blas_choices"]
    assert set(choices) == {"draft", "verify-17", "verify-1"}
    for choice in choices.values():
        assert choice["chosen"] in graphs.BLAS_LIBRARIES
        assert all(choice[name] > 0 for name in graphs.BLAS_LIBRARIES)
    assert torch.backends.cuda.preferred_blas_library() == before
    divergence = first_divergence(engine.target.hf, prompt, eager.token_ids, quick.token_ids)
    assert divergence is None or divergence.near_tie, divergence.describe()


def test_engine_info_names_the_gemm_library_where_stages_are_captured(tmp_path, monkeypatch):
    from ddtree_diag.engine.info import engine_info_rows

    monkeypatch.delenv("DDTREE_DIAG_BLAS", raising=False)
    target = fx.make_target(tmp_path / "target")
    draft = fx.make_draft(tmp_path / "draft", block_size=4)
    engines = {dtype: load_engine(target, draft, device="cpu", dtype=dtype) for dtype in ("bf16", "fp32")}
    for engine in engines.values():
        engine.use_path("fast")
        assert engine.info()["gemm_library"] is None  # on CPU nothing is captured: torch's GEMMs

    def library(engine, path="fast"):  # as on a GPU: the row reads the device type and the path only
        monkeypatch.setattr(engine, "device", torch.device("cuda"))
        engine.use_path(path)
        return engine._gemm_library()

    monkeypatch.setattr(graphs, "blas_switchable", lambda: False)  # this CPU build: no choosing
    assert library(engines["bf16"]) == "torch's default (this torch build cannot switch BLAS libraries)"
    monkeypatch.setattr(graphs, "blas_switchable", lambda: True)  # as a CUDA build
    assert library(engines["bf16"]) == "cuBLAS or cuBLASLt, per draft / verify shape the faster replay at capture"
    assert library(engines["fp32"]) == "torch's default (fp32: the eager path's GEMMs)"
    for path in ("fast-nograph", "eager"):
        assert library(engines["bf16"], path) is None
    monkeypatch.setenv("DDTREE_DIAG_BLAS", "cublaslt")
    assert library(engines["fp32"], "fast-compile") == "cublaslt (DDTREE_DIAG_BLAS)"
    monkeypatch.setenv("DDTREE_DIAG_BLAS", "rocblas")
    with pytest.raises(UsageError, match="DDTREE_DIAG_BLAS='rocblas'"):
        library(engines["bf16"])

    base = {"model": "m", "target_path": "t", "draft_path": "d", "decode_path": "fast", "fused_kernels": True}
    assert "GEMM library" not in dict(engine_info_rows(base))
    rows = dict(engine_info_rows(base | {"gemm_library": "cublas (DDTREE_DIAG_BLAS)"}))
    assert rows["GEMM library"] == "cublas (DDTREE_DIAG_BLAS)"
