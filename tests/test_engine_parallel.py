"""Tensor parallelism of the target (``engine.parallel``): the shard plan's refusals in process, and
T=0 losslessness across processes: 2 gloo processes on the CPU decode the tiny dense and hybrid
targets exactly as one process does (fp32), in AR, chain and tree mode at several budgets.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine, parallel  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {
        "dense": fx.make_target(root / "dense"),
        "llama": fx.make_target(root / "llama", model_type="llama"),  # q/k/v/o biases: o_proj's added once
        "hybrid": fx.make_hybrid_target(root / "hybrid", pattern="LLAL"),
        "draft": fx.make_draft(root / "draft", block_size=4, layer_ids=(0, 2)),
    }


def _config(**changes):
    base = dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=4, intermediate_size=256,
                num_hidden_layers=2, hidden_size=64)
    base.update(changes)
    return SimpleNamespace(**base)


def test_plan_splits_heads_and_mlp():
    plan = parallel.plan_shards(_config(), 2)
    assert (plan.heads, plan.kv_heads, plan.intermediate, plan.linear_v_heads) == (4, 2, 128, 0)
    assert parallel.plan_shards(_config(), 1).heads == 8


@pytest.mark.parametrize(
    ("changes", "world", "words"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "6 attention heads over 4 devices"),
        ({"num_key_value_heads": 2}, 4, "2 key/value heads over 4 devices"),
        ({"intermediate_size": 250}, 4, "250 MLP channels"),
        ({"num_experts": 8}, 2, "MoE"),
        ({"num_local_experts": 8}, 2, "MoE"),  # Mixtral, gpt-oss
        ({"n_routed_experts": 8}, 2, "MoE"),  # GLM-MoE
        ({"kv_lora_rank": 512}, 2, "latent attention"),  # DeepSeek-V3's attention
        ({"model_type": "phi3"}, 2, "q|k|v in one linear"),
        ({}, 0, "--devices must be >= 1"),
    ],
)
def test_plan_refuses_in_one_line(changes, world, words):
    with pytest.raises(UsageError) as err:
        parallel.plan_shards(_config(**changes), world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_plan_refuses_gated_deltanet_heads_that_do_not_divide(models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["hybrid"])
    assert parallel.plan_shards(config, 2).linear_k_heads == 1  # 2 key heads, 4 value heads
    config.linear_num_key_heads = 3
    with pytest.raises(UsageError, match="3 Gated DeltaNet key heads over 2 devices"):
        parallel.plan_shards(config, 2)


def test_a_split_target_refuses_the_fast_path(models):
    engine = load_engine(models["dense"], device="cpu", dtype="fp32", decode_path="eager")
    engine.target.shard_plan = parallel.plan_shards(engine.target.hf.config, 2)
    with pytest.raises(UsageError, match="split over 2 devices: only the eager decode path"):
        engine.decoder("fast-nograph")


def _requests(budgets, modes=("tree",)):
    requests = []
    for prompt in fx.PROMPTS[:2]:
        for budget in budgets:
            for mode in modes:
                requests.append(dict(prompt_ids=prompt, tree_budget=budget, max_tokens=fx.MAX_TOKENS, mode=mode))
    return requests


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kind", "budgets"), [("dense", (0, 1, 4, 16, 64)), ("hybrid", (0, 2, 16)), ("llama", (0, 4))]
)
def test_two_gloo_processes_decode_as_one(models, kind, budgets):
    """T=0, fp32: the 2-process output (each rank half the heads and MLP) equals the 1-process output."""
    requests = _requests(budgets) + _requests((4,), modes=("chain",))
    engine = load_engine(models[kind], draft=models["draft"], device="cpu", dtype="fp32", decode_path="eager")
    single = [engine.generate_ids(**request).token_ids for request in requests]
    split = parallel.launch(parallel.generate_job, 2, "cpu",
                            (str(models[kind]), str(models["draft"]), "fp32", requests))
    assert split == single
    assert len({len(tokens) for tokens in single}) >= 1 and all(single)


def _fail_on_rank_one(rank, world, device_type):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("no such shard\nsecond line")
    dist.barrier()  # rank 0 waits in a collective that never completes: the launcher ends it
    return "unreachable"


@pytest.mark.e2e
def test_a_failing_rank_is_one_line():
    with pytest.raises(RuntimeError, match=r"^rank 1: ValueError: no such shard$"):
        parallel.launch(_fail_on_rank_one, 2, "cpu")


def test_engine_info_plans_the_split(models, capsys):

    from ddtree_diag.commands.engine_info import run_engine_info

    assert run_engine_info(str(models["hybrid"]), None, str(models["draft"]), "cpu", None, True, devices=2) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["heads"] == 2 and data["plan"]["linear_v_heads"] == 2 and data["backend"] == "gloo"
    assert data["sharded_weights_bytes_per_device"] * 2 + data["replicated_weights_bytes"] == data[
        "target_weights_bytes"]
    assert run_engine_info(str(models["dense"]), None, None, "cpu", None, False, devices=2) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "per device: 2 q / 1 kv attention heads, 64 MLP channels" in lines
    assert "fits: yes (estimate; not loaded)" in lines
    with pytest.raises(UsageError, match=r"^cannot split 4 attention heads over 3 devices"):
        run_engine_info(str(models["dense"]), None, None, "cpu", None, False, devices=3)


def test_engine_info_refuses_a_split_that_does_not_fit(tmp_path, capsys):
    """A ~140B-parameter dense config in fp32 (560 GB) over 2 CPU processes: refused in one line."""
    fx.make_tokenizer(tmp_path)
    big = tmp_path
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=fx.VOCAB, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=160, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=4096)
    (big / "config.json").write_text(json.dumps(config))
    from ddtree_diag.commands.engine_info import run_engine_info

    with pytest.raises(UsageError) as err:
        run_engine_info(str(big), None, None, "cpu", "fp32", False, devices=2)
    assert str(err.value).startswith("the split does not fit: 2 devices need an estimated")
    assert "\n" not in str(err.value)


@pytest.mark.e2e
def test_serve_with_two_devices_answers_as_one(models):
    """``serve --devices 2`` (this process rank 0, one spawned follower): the T=0 answer equals the
    1-process engine's, over HTTP, streamed and not; the followers end with the server."""
    import httpx

    from tests.support.processes import stop_serve

    engine = load_engine(models["hybrid"], draft=models["draft"], device="cpu", dtype="fp32", decode_path="eager")
    messages = [{"role": "user", "content": "hi there"}]
    expected = engine.generate(messages=messages, tree_budget=8, max_tokens=16)
    process, url = fx.start_server(models["hybrid"], models["draft"], "--devices", "2", "--tree-budget", "8")
    try:
        body = {"model": models["hybrid"].name, "messages": messages, "max_tokens": 16, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["message"]["content"] == expected.text
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        streamed = "".join((json.loads(c[6:])["choices"][0]["delta"].get("content") or "") for c in chunks)
        assert streamed == expected.text
    finally:
        stop_serve(process)


@pytest.mark.e2e
def test_probe_engine_with_two_devices(models, cli):
    """``probe --engine --devices 2``: every budget's answer is identical to the split engine's own AR."""
    probe = cli("probe", "--engine", "--target", str(models["dense"]), "--draft", str(models["draft"]), "--device",
                "cpu", "--dtype", "fp32", "--devices", "2", "--budget", "0,16", "--thinking", "off",
                "--max-tokens", "12", "--baseline", "budget0", "--json", "-", timeout=300)
    report = probe.json()
    assert [r["status"] for r in report["results"]] == ["ok", "ok"], probe.stderr
    assert all(r["baseline"]["verdict"] == "identical" for r in report["results"])
    assert report["results"][1]["spec"]["decode_rounds"] >= 1


@pytest.mark.e2e
def test_rank_zero_stops_every_rank(models):
    """Cancel, deadline, a failing callback: rank 0 decides and the follower stops with it, so the
    next request still decodes in step (and equals the 1-process output)."""
    import time

    engine = load_engine(models["dense"], draft=models["draft"], device="cpu", dtype="fp32", decode_path="eager")
    split = parallel.ParallelEngine(2, "cpu", str(models["dense"]), str(models["draft"]), dtype="fp32")
    try:
        prompt = fx.PROMPTS[1]
        rounds = []
        cancelled = split.generate_ids(prompt, tree_budget=4, max_tokens=24,
                                       on_token=lambda ids, text: rounds.append(ids) or len(rounds) < 2)
        assert cancelled.finish_reason == "cancelled" and len(rounds) == 2
        late = split.generate_ids(prompt, tree_budget=4, max_tokens=24, deadline=time.perf_counter())
        assert late.finish_reason == "timeout"

        def boom(ids, text):
            raise KeyError("callback")

        with pytest.raises(KeyError):
            split.generate_ids(prompt, tree_budget=4, max_tokens=24, on_token=boom)
        with pytest.raises(UsageError, match="the prompt is empty"):
            split.generate_ids([], max_tokens=4)
        for budget in (0, 16):
            expected = engine.generate_ids(prompt, tree_budget=budget, max_tokens=24).token_ids
            assert split.generate_ids(prompt, tree_budget=budget, max_tokens=24).token_ids == expected
        assert split.info()["parallel"]["plan"]["heads"] == 2
    finally:
        split.close()
