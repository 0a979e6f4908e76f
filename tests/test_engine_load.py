"""Engine loading, refusals with one-line errors, prompts/templates, backend adapter, engine-info."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.backends.engine import EngineBackend, split_reasoning  # noqa: E402
from ddtree_diag.commands.engine_info import run_engine_info  # noqa: E402
from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.arch import check_supported  # noqa: E402
from ddtree_diag.engine.info import engine_info_rows  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from ddtree_diag.records import ProbeCase  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]




@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    return SimpleNamespace(
        root=root, target=fx.make_target(root / "target"), draft=fx.make_draft(root / "draft")
    )


@pytest.fixture(scope="module")
def engine(paths):
    return load_engine(paths.target, paths.draft, device="cpu")


def copy_draft(paths, name, **changes):
    directory = paths.root / name
    shutil.copytree(paths.draft, directory, dirs_exist_ok=True)
    data = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            data["dflash_config"][key] = value
        else:
            data[key] = value
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def test_info_reports_what_was_loaded(engine):
    info = engine.info()
    assert info["layers"] == fx.TARGET_LAYERS and info["hidden_size"] == fx.HIDDEN
    assert info["draft"]["target_layer_ids"] == [0, 2] and info["draft"]["block_size"] == 4
    assert info["draft"]["mask_token_id"] == fx.VOCAB - 1
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["memory"]["target_weights_bytes"] > 0 and info["memory"]["draft_weights_bytes"] > 0
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in info["stop_token_ids"]


def test_render_prompt_passes_enable_thinking(engine):
    messages = [{"role": "user", "content": "hi"}]
    off = engine.tokenizer.decode(engine.render_prompt(messages, enable_thinking=False))
    on = engine.tokenizer.decode(engine.render_prompt(messages, enable_thinking=True))
    default = engine.tokenizer.decode(engine.render_prompt(messages, enable_thinking=None))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and on == default


def test_generate_from_messages_stops_and_cancels(engine):
    messages = [{"role": "user", "content": "hello"}]
    base = engine.generate(messages=messages, enable_thinking=False, max_tokens=12)
    assert base.prompt_tokens == len(engine.render_prompt(messages, enable_thinking=False))
    assert base.finish_reason in ("length", "stop") and base.text == engine.tokenizer.decode(
        [t for t in base.token_ids if t not in engine.stop_token_ids], skip_special_tokens=True
    )
    seen: list[list[int]] = []

    def cancel_after_two(ids, _delta):
        seen.append(ids)
        return len(seen) < 2

    cancelled = engine.generate(messages=messages, max_tokens=12, on_token=cancel_after_two)
    assert cancelled.finish_reason == "cancelled" and len(seen) == 2
    assert sum(len(ids) for ids in seen) == cancelled.completion_tokens
    assert len(base.text) > 3  # the random target writes bytes; a stop string can be cut from it
    stop = base.text[1:3]
    stopped = engine.generate(messages=messages, enable_thinking=False, max_tokens=12, stop=[stop])
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert base.text.startswith(stopped.text)


def test_llama_family_with_bias_is_lossless(tmp_path):
    target = fx.make_target(tmp_path / "llama", model_type="llama", seed=3)
    engine = load_engine(target, fx.make_draft(tmp_path / "draft", block_size=4), device="cpu")
    prompt = [3, 14, 15, 92, 65]
    reference = engine.greedy_reference(prompt, 16, stop_ids=[])
    for budget in (0, 4, 16):
        assert (
            engine.generate_ids(prompt, tree_budget=budget, max_tokens=16, stop_token_ids=[]).token_ids
            == reference
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 32}, "hidden size 32 does not match"),
        ({"target_layer_ids": [0, 9]}, r"target_layer_ids \[9\] do not exist"),
        ({"vocab_size": 500}, "vocabulary size 500 does not match"),
        ({"mask_token_id": 400}, "outside the target vocabulary"),
    ],
)
def test_draft_that_does_not_fit_is_refused(paths, changes, message):
    draft = copy_draft(paths, "bad_" + "_".join(changes), **changes)
    if "hidden_size" in changes:  # weights must match the config for the fit check to be reached
        fx.make_draft(draft, block_size=4)
        model = json.loads((draft / "config.json").read_text())
        model["hidden_size"] = 32
        from ddtree_diag.engine.draft import DFlashDraft, DraftConfig, save_draft

        config = DraftConfig.from_dict(model)
        save_draft(DFlashDraft(config), config, draft)
    with pytest.raises(UsageError, match=message):
        load_engine(paths.target, draft)


def test_missing_paths_and_bad_options(paths, tmp_path):
    with pytest.raises(UsageError, match="target model directory not found"):
        load_engine(tmp_path / "nope")
    with pytest.raises(UsageError, match="draft directory not found"):
        load_engine(paths.target, tmp_path / "nope")
    with pytest.raises(UsageError, match="GGUF file not found"):
        load_engine(tmp_path, gguf_file="missing.gguf")
    with pytest.raises(UsageError, match="unknown dtype"):
        load_engine(paths.target, dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            load_engine(paths.target, device="cuda")


def test_unloadable_gguf_is_one_line(tmp_path):
    pytest.importorskip("gguf")
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UsageError, match=r"transformers cannot load the GGUF file model\.gguf") as info:
        load_engine(bogus)
    assert "\n" not in str(info.value)


def test_supported_and_refused_model_types():
    supported = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next", "qwen3", "llama", "qwen3_moe", "gpt_oss")
    for model_type in supported:
        check_supported(SimpleNamespace(model_type=model_type))
    # a Qwen3.5 vision-language config: its text model decides
    check_supported(SimpleNamespace(model_type="qwen3_5", text_config=SimpleNamespace(model_type="qwen3_5_text")))
    for config in (
        SimpleNamespace(model_type="falcon_h1", layer_types=["linear_attention", "full_attention"]),
        SimpleNamespace(model_type="qwen3", layer_types=["linear_attention", "full_attention"]),
    ):
        with pytest.raises(UsageError, match=r"hybrid .*model the engine does not support"):
            check_supported(config)
    with pytest.raises(UsageError, match="'gemma2' is a model the engine does not support"):
        check_supported(SimpleNamespace(model_type="gemma2"))
    # a supported type with a setting our forward does not apply: refused, not run wrong
    for field, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                         ("use_bidirectional_attention", True)):
        with pytest.raises(UsageError, match=f"sets {field}=.*does not apply"):
            check_supported(SimpleNamespace(model_type="gemma3_text", **{field: value}))
    check_supported(SimpleNamespace(model_type="gemma3_text", final_logit_softcapping=None))


def test_prompt_longer_than_context_and_bad_budget(engine):
    with pytest.raises(UsageError, match="prompt has 600 tokens"):
        engine.generate(prompt_ids=[5] * 600, max_tokens=4)
    with pytest.raises(UsageError, match="tree_budget"):
        engine.generate(prompt_ids=[5, 6], tree_budget=-1)
    with pytest.raises(UsageError, match=f"prompt token id {fx.VOCAB + 3} is outside the target's vocabulary"):
        engine.generate(prompt_ids=[5, fx.VOCAB + 3], max_tokens=2)


def test_backend_maps_generation_to_probe_result(paths):
    backend = EngineBackend(paths.target, paths.draft, device="cpu", dtype="fp32")
    notes = backend.prepare([])
    assert notes and "cpu" in notes[0]
    case = ProbeCase("hello", [{"role": "user", "content": "Say hello."}], enable_thinking=False,
                     tree_budget=16, max_tokens=10)
    result = backend.run(case)
    assert result.ok and result.dialect == "engine" and result.spec.source == "engine"
    assert result.completion_tokens == len(result.extras["token_ids"])
    assert result.spec.decode_rounds == len(result.spec.acceptance_lengths)
    assert sum(result.spec.acceptance_lengths) == result.completion_tokens - 1
    assert result.spec.accepted_tokens == sum(n - 1 for n in result.spec.acceptance_lengths)
    assert result.spec.draft_tokens == sum(result.extras["tree_sizes"])
    assert set(result.timings.stages) == {"draft", "tree", "verify", "commit"}
    assert result.timings.e2e_s >= result.timings.ttft_s > 0
    too_long = ProbeCase("long", [{"role": "user", "content": "x " * 600}], max_tokens=4)
    failed = backend.run(too_long)
    assert failed.status == "engine_error" and "context" in failed.error and "\n" not in failed.error
    info = backend.target_info()
    assert info["backend"] == "engine" and info["block_size"] == 4
    backend.close()


def test_split_reasoning():
    assert split_reasoning("<think>\nhmm\n</think>\n\nHello.") == ("Hello.", "hmm")
    assert split_reasoning("Hello.") == ("Hello.", None)
    # a template that opened the block: reasoning up to the tag, all of it when it never comes
    assert split_reasoning("hmm\n</think>\n\nHello.", prefilled=True) == ("Hello.", "hmm")
    assert split_reasoning("still thinking", prefilled=True) == ("", "still thinking")
    # one that did not: a text that does not open a block is all answer, tags and all
    assert split_reasoning("hmm</think>Hello.") == ("hmm</think>Hello.", None)


def test_engine_info_json_and_table(paths, capsys):
    assert run_engine_info(str(paths.target), None, str(paths.draft), None, None, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["draft"]["block_size"] == 4 and data["layers"] == fx.TARGET_LAYERS
    assert run_engine_info(str(paths.target), None, None, None, None, as_json=False) == 0
    out = capsys.readouterr().out  # captured: not a terminal, so plain "field: value" lines
    lines = out.splitlines()
    assert "draft: none (AR only)" in lines and f"target layers: {fx.TARGET_LAYERS}" in lines
    assert f"model: {paths.target.name}" in lines and data["model"] == paths.target.name
    assert not set(out) & set("┃│─━┏┗+|"), "no table borders when piped"


@pytest.mark.parametrize(("model_type", "dtype"), [("qwen3", "bf16"), ("gpt_oss", "fp16"), ("glm4_moe", "bf16")])
def test_a_half_precision_load_keeps_what_hf_keeps_in_fp32(tmp_path, model_type, dtype):
    """The rotary inv_freq, GLM-MoE's router bias and a keep-in-fp32 list's parameters (gpt-oss's
    norms in fp16) stay fp32 as in HF's own load: cast, inv_freq would put a long context's rotary
    angles far off. The engine's cos/sin at position 3000 then equal those of HF's own model."""
    from transformers import AutoModelForCausalLM

    path = fx.make_target(tmp_path / model_type, model_type=model_type)
    engine = load_engine(path, device="cpu", dtype=dtype)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=half)
    ours = dict(engine.target.hf.named_buffers()) | dict(engine.target.hf.named_parameters())
    theirs = {name: t for name, t in (*reference.named_buffers(), *reference.named_parameters())
              if t.dtype == torch.float32}
    assert any(name.endswith("inv_freq") for name in theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
    if model_type == "gpt_oss":
        assert any(name.endswith("input_layernorm.weight") for name in theirs)
    if model_type == "glm4_moe":
        assert any(name.endswith("e_score_correction_bias") for name in theirs)
    positions = torch.tensor([3000, 3001])
    hidden = torch.zeros(1, 2, fx.HIDDEN, dtype=half)
    cos, sin = engine.target.rope(hidden, positions)
    want_cos, want_sin = reference.model.rotary_emb(hidden, positions[None])
    if engine.target.arch.rope_on_halves:
        want_cos, want_sin = torch.cat([want_cos] * 2, -1), torch.cat([want_sin] * 2, -1)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)


def test_a_checkpoint_missing_weights_is_refused_in_one_line(tmp_path):
    """HF fills missing weights with random values and says so in a warning only."""
    path = fx.make_target(tmp_path / "t")
    fx.rewrite_checkpoint(path, lambda state: {k: v for k, v in state.items() if "layers.1.mlp.down_proj" not in k})
    with pytest.raises(UsageError, match=r"lacks 1 weight\(s\).*layers\.1\.mlp\.down_proj") as info:
        load_engine(path, device="cpu")
    assert "\n" not in str(info.value)


def test_quantized_checkpoints_fp8_loads_and_says_so_other_methods_are_refused(tmp_path):
    """Block-wise FP8 (Qwen3-*-FP8): on a CPU HF dequantizes it, the engine decodes it as HF's own
    model does, and engine-info says what it loaded; a method the engine does not load is refused
    in one line before any weight is read."""
    path = fx.make_target(tmp_path / "fp8")
    fx.rewrite_checkpoint(path, fx.fp8_quantize, quantization_config=fx.FP8_CONFIG)
    engine = load_engine(path, device="cpu")
    assert engine.info()["quantization"] == "fp8, dequantized to float32"
    rows = dict(engine_info_rows(engine.info() | {"model": "m", "target_path": "t", "draft_path": None}))
    assert rows["quantization"] == "fp8, dequantized to float32"
    prompt = fx.PROMPTS[2]
    tokens = engine.generate_ids(prompt, max_tokens=10, stop_token_ids=[]).token_ids
    with torch.no_grad():
        logits = engine.target.hf(torch.tensor([prompt + tokens])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
    assert "quantization" not in load_engine(fx.make_target(tmp_path / "plain"), device="cpu").info()
    awq = fx.make_target(tmp_path / "awq")
    fx.rewrite_checkpoint(awq, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(UsageError, match="quantized with 'awq', which the engine does not load") as info:
        load_engine(awq, device="cpu")
    assert "\n" not in str(info.value)
