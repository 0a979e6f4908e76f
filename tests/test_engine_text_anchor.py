"""A long output's text decoded from an anchor (``GenerationRecorder.text``), not whole each round.

The recorder decodes the output's text every round (stop strings, the stream). Past
``INCREMENTAL_FROM`` tokens it decodes only the tail after an anchor, with a few tokens of context
before it, and redoes a whole decode every ``RESYNC_TOKENS``. That must give the same text as a
whole decode at every round, for the ways tokenizers decode: byte-level BPE (characters split
between tokens), SentencePiece's metaspace (a decode's first space dropped), and the embedded
SmolLM2's own tokenizer on real text.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

pytestmark = pytest.mark.engine

TEXT = (
    "Speculative decoding — ünïcödé, 漢字かな 🙂🚀: don't won't it's. The draft proposes; the target "
    "verifies (lossless) . Numbers 1,234.5 and  two  spaces , ok ?\n"
    "def f(x):\n    return x ** 2  # comment\n\n"
)


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: characters, spaces as "▁", a decode's first space dropped."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(set(TEXT.replace(" ", "▁")) | {"▁"})
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return backend


def run_rounds(ids: list[int], decode, seed: int | None = 0, incremental: bool = True, **request):
    """Feed ``ids`` through a recorder in rounds of 1-6 tokens (seed None: one token each, so the
    anchors fall at INCREMENTAL_FROM + k * RESYNC_TOKENS exactly); returns (the recorder, the text it
    gave after each round, the whole decode after each round, the streamed pieces, the lengths
    decode_text was asked for)."""
    asked: list[int] = []
    pieces: list[str] = []

    def counted(part: list[int]) -> str:
        asked.append(len(part))
        return decode(part)

    settings = dict(prompt_ids=[1], mode="tree", tree_budget=4, max_tokens=len(ids), stop_ids=set(),
                    on_token=lambda _ids, text: pieces.append(text) is None)
    settings.update(request)
    record = GenerationRecorder(DecodeRequest(**settings), counted, incremental=incremental)
    rng = random.Random(seed)
    given, wanted = [], []
    record.first_token(ids[0])
    position = 1
    while not record.done:
        size = 1 if seed is None else rng.randint(1, 6)
        record.round(ids[position : position + size], tree_size=4)
        position += size
        given.append(record.text())
        wanted.append(decode(record.output))
    return record, given, wanted, pieces, asked


@pytest.fixture(scope="module")
def smollm2_tokenizer(embedded_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target_dir)


def cases(smollm2_tokenizer=None):
    metaspace = metaspace_tokenizer()
    yield "bytes", byte_tokens(TEXT * 12), byte_decode
    yield "metaspace", metaspace.encode(TEXT * 12).ids, metaspace.decode
    if smollm2_tokenizer is not None:
        yield "smollm2", smollm2_tokenizer.encode(TEXT * 20), \
            lambda ids: smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["bytes", "metaspace", "smollm2"])
def test_the_text_equals_a_whole_decode_after_every_round(kind, request) -> None:
    tokenizer = request.getfixturevalue("smollm2_tokenizer") if kind == "smollm2" else None
    ids, decode = next((i, d) for name, i, d in cases(tokenizer) if name == kind)
    assert len(ids) > 3 * GenerationRecorder.RESYNC_TOKENS  # several anchors
    # random rounds, then one-token rounds on the output shifted by 0-7 tokens: an anchor falls
    # before each kind of token (a metaspace "▁" whose space a tail's own decode would drop, a
    # character's later bytes)
    runs = [(seed, 0) for seed in range(2)] + [(None, shift) for shift in range(8)]
    for seed, shift in runs:
        record, given, wanted, pieces, asked = run_rounds(ids[shift:], decode, seed=seed)
        assert given == wanted
        assert record.incremental  # no difference was ever found at a resync
        final = record.result().text
        assert final == decode(ids[shift:]) and "".join(pieces) == final
        # past the first INCREMENTAL_FROM tokens, a round decodes its tail, not the whole output:
        # whole decodes (every RESYNC_TOKENS, and the final text) are few
        long_ones = [n for n in asked if n > GenerationRecorder.RESYNC_TOKENS + GenerationRecorder.CONTEXT_TOKENS]
        assert len(long_ones) <= 2 * (len(ids) // GenerationRecorder.RESYNC_TOKENS) + 2
        assert len(asked) < 3 * len(given) + 10


def test_whole_decodes_every_round_when_not_incremental() -> None:
    ids = byte_tokens(TEXT * 6)
    _, given, wanted, _, asked = run_rounds(ids, byte_decode, incremental=False)
    assert given == wanted
    assert len(asked) == len(given) + 1  # the first token's, then one per round
    assert asked[-1] == len(ids) and max(asked) == len(ids)


def test_a_text_that_is_not_local_falls_back_to_whole_decodes() -> None:
    """A decoder whose text of a prefix depends on the tokens after it (here: every "x" written as
    "y" once the output is 600 tokens long, which no tail's decode is) is caught at the next
    resync: from there every text is a whole decode, and the final text is whole."""
    ids = byte_tokens("abcdefx ghij " * 120)  # ASCII: a text's length is its token count

    def rewriting(part: list[int]) -> str:
        text = byte_decode(part)
        return text.replace("x", "y") if len(part) >= 600 else text

    record, given, wanted, _, _ = run_rounds(ids, rewriting)
    assert not record.incremental
    caught_by = 600 + GenerationRecorder.RESYNC_TOKENS  # the anchor before 600 resyncs by then
    late = [(a, b) for a, b in zip(given, wanted, strict=True) if len(b) >= caught_by]
    assert late and all(a == b for a, b in late)
    assert record.result().text == rewriting(ids)


def test_a_stop_string_past_the_anchor_stops_where_a_whole_decode_finds_it() -> None:
    ids = byte_tokens(TEXT * 8 + "FINISHED and more text after it")
    record, given, _, _, _ = run_rounds(ids, byte_decode, stop=["FINISHED"])
    assert record.finish == "stop"
    assert "FINISHED" in given[-1] and "FINISHED" not in given[-2]
    assert record.result().text == TEXT * 8


def test_a_harmony_engine_decodes_whole_texts(tmp_path, monkeypatch) -> None:
    """gpt-oss's harmony rewrite reads the whole output: its engine's recorders get no anchor."""
    from ddtree_diag.engine import eager, load_engine
    from tests.support import engine_fixtures as fx

    made: list[bool] = []
    real = eager.GenerationRecorder

    def recorder(*args, **kwargs):
        made.append(kwargs.get("incremental", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(eager, "GenerationRecorder", recorder)
    for harmony, name in ((True, "harmony"), (False, "plain")):
        target = fx.make_target(tmp_path / name, model_type="gpt_oss" if harmony else "qwen3")
        fx.make_tokenizer(tmp_path / name, harmony=harmony)
        engine = load_engine(target, device="cpu")
        engine.use_path("eager")
        engine.generate_ids([1, 2, 3], tree_budget=0, max_tokens=3, stop_token_ids=[])
    assert made == [False, True]
