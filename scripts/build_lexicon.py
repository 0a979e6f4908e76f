"""Build the word lists the garbage detector's subword-salad signal reads, and the test word lists.

Source: wordfreq's "small" frequency lists (https://github.com/rspeer/wordfreq, data under
CC-BY-SA 4.0), read straight from its wheel (a ``.whl`` path or an installed ``wordfreq``), with
``msgpack``. Neither is needed at run time: the output is plain gzip'd text in the package.

Writes
- ``ddtree_diag/data/lexicon/index.json``: per language its script, the number of words kept,
  the share of running text the top ``--keep`` words cover and the share of *short* (<= 4 letters)
  running words they miss (both from wordfreq's own frequencies: what a clean text's out-of-lexicon rate
  should be), and its 150 most frequent words (language identification);
- ``ddtree_diag/data/lexicon/<lang>.txt.gz``: the top ``--keep`` words, and the words of 5+ letters
  up to rank ``--keep-long``, one per line;
- ``tests/data/quality/words.json``: for the test generators, per language ~2000 words drawn by
  frequency from the top ``--keep`` ranks AND the ranks past them (so generated clean text has the
  rare words real text has; the short ones the lexicon does not hold), with their frequencies.

    python scripts/build_lexicon.py --wheel wordfreq-3.1.1-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import unicodedata
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Languages written with spaces between words (the salad signal needs word boundaries).
LANGUAGES = [
    "ar", "bg", "bn", "ca", "cs", "da", "de", "el", "en", "es", "fa", "fi", "fil", "fr", "he", "hi", "hu", "id",
    "is", "it", "lt", "lv", "mk", "ms", "nb", "nl", "pl", "pt", "ro", "ru", "sh", "sk", "sl", "sv", "ta", "tr",
    "uk", "ur", "vi",
]
LONG = 5  # letters: a word this long is kept past --keep (to --keep-long)
TEST_LANGUAGES = ["en", "es", "fr", "de", "it", "pt", "nl", "pl", "ru", "uk", "el", "tr", "fi", "ar", "he", "hi", "id",
                  "sv", "cs"]


def read_lists(wheel: str | None) -> dict[str, list[tuple[str, float]]]:
    import msgpack

    def load(raw: bytes) -> list[tuple[str, float]]:
        buckets = msgpack.loads(gzip.decompress(raw), strict_map_key=False)[1:]
        return [(word, 10 ** (-cb / 100)) for cb, words in enumerate(buckets) for word in words]

    out = {}
    if wheel:
        with zipfile.ZipFile(wheel) as archive:
            for lang in LANGUAGES:
                out[lang] = load(archive.read(f"wordfreq/data/small_{lang}.msgpack.gz"))
    else:
        import wordfreq

        data = Path(wordfreq.__file__).parent / "data"
        for lang in LANGUAGES:
            out[lang] = load((data / f"small_{lang}.msgpack.gz").read_bytes())
    return out


def script_of(words: list[str]) -> str:
    counts: dict[str, int] = {}
    for word in words[:500]:
        for ch in word:
            if ch.isalpha():
                name = unicodedata.name(ch, "").split(" ")[0]
                counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wheel", help="wordfreq wheel (default: the installed wordfreq)")
    parser.add_argument("--keep", type=int, default=16000, help="words kept per language")
    parser.add_argument(
        "--keep-long", type=int, default=32000,
        help=f"words of {LONG}+ letters are kept up to this rank (the short ones stop at --keep)",
    )
    args = parser.parse_args()
    lists = read_lists(args.wheel)
    out_dir = ROOT / "ddtree_diag" / "data" / "lexicon"
    out_dir.mkdir(parents=True, exist_ok=True)
    index = {}
    test_words = {}
    rng = random.Random(17)
    for lang, entries in lists.items():
        entries = [(w, f) for w, f in entries if any(ch.isalpha() for ch in w)]
        total = sum(f for _, f in entries)
        # Past the first --keep words, the long ones to --keep-long: technical and inflected words
        # ("repository", "headers", "encoding") that clean answers use. Salad's pieces are short,
        # and short words stay at --keep, so the pieces stay unknown.
        kept = entries[: args.keep] + [(w, f) for w, f in entries[args.keep : args.keep_long] if len(w) >= LONG]
        # The thresholds' calibration: what the top --keep words cover (the long words kept past
        # them only leave a clean text fewer unknown words; they must not make the signal stricter).
        coverage = sum(f for _, f in entries[: args.keep]) / total
        short_missed = sum(f for w, f in entries[args.keep :] if len(w) <= 4) / total
        index[lang] = {
            "script": script_of([w for w, _ in entries]),
            "words": len(kept),
            "coverage": round(coverage, 4),
            "short_missed": round(short_missed, 5),
            "top": [w for w, _ in entries[:150]],
        }
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9, mtime=0) as fh:
            fh.write("\n".join(sorted(w for w, _ in kept)).encode("utf-8"))
        (out_dir / f"{lang}.txt.gz").write_bytes(buffer.getvalue())
        if lang in TEST_LANGUAGES:
            # 1500 of the top words (by frequency) and 500 past the top --keep: the rare words real
            # text has (the long ones among them to --keep-long are in the lexicon, as in real text).
            head = entries[: args.keep]
            tail = entries[args.keep : args.keep * 3]
            picks = rng.choices(head, weights=[f for _, f in head], k=1500) + rng.sample(tail, min(500, len(tail)))
            test_words[lang] = sorted({w: f for w, f in picks}.items(), key=lambda wf: -wf[1])
    (out_dir / "index.json").write_text(json.dumps(index, ensure_ascii=False, indent=0), encoding="utf-8")
    words_path = ROOT / "tests" / "data" / "quality" / "words.json"
    words_path.write_text(
        json.dumps({k: [[w, round(f, 9)] for w, f in v] for k, v in test_words.items()}, ensure_ascii=False),
        encoding="utf-8",
    )
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"{len(index)} languages, {size / 1024:.0f} KiB in {out_dir}; test words in {words_path}")


if __name__ == "__main__":
    main()
