"""The reason codes and the detectors that find them: one registry that the code list, the loop
subset and the kinds the findings use, the README table, and what ``assess`` runs all come from.
Codes are stable; other tools may match on them.

``FAMILIES`` lists the signal modules; each lists its detectors in ``DETECTORS`` (the shape and
the ``reads`` scopes are in ``context``). ``detectors(scope)`` is what ``assess`` runs on each
text, in family order, which is also the order reasons are reported in before the stable sort
by weight (so it breaks ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ddtree_diag.checks.quality import content, encoding, hollow, leaks, loops, salad, scripts, stops, stutter, thinking
from ddtree_diag.checks.quality.context import SCOPES, Detector, scope_of


@dataclass(frozen=True)
class ReasonCode:
    code: str
    severity: str  # as documented: "hard", "soft", "hard/soft", "info", ...
    meaning: str  # one line, Markdown
    family: str  # the module that finds it
    loop: bool = False  # "the text repeats itself" (findings read these)
    kind: str = ""  # what it says of the fault, in the findings' words ("chat-template tokens")


REPETITION = "repetition"  # the kind every loop code shares


REGISTRY: tuple[ReasonCode, ...] = (
    ReasonCode("empty_output", "hard", "no answer, or only whitespace, punctuation or a bare list marker", "stops",
               kind="an empty answer"),
    ReasonCode("premature_stop", "hard/soft",
               "`stop` on an unfinished sentence (`Hello,`, `Here is the code:`), or inside a word (`Rayleigh "
               "scatt`: no word of the text's language, the start of one; hard only in a text that ends its other "
               "sentences, soft on a list item or a 4-letter cut)",
               "stops", kind="a stop mid-sentence"),
    ReasonCode("restart", "hard", "the answer breaks off inside a word and starts its sentence again "
               "(`…into IP addr DNS, the Domain Name System, translates … into IP addresses`)", "stops",
               kind="a restart mid-word"),
    ReasonCode("token_loop", "hard",
               "one word or character repeated back to back (`the the the the`; one letter or blank 64+ times into "
               "the token limit, a digit 120+, or any 200+; a markup character or border, `-`, `=`, `\\|---\\|`, "
               "over 120+ characters into the token limit)", "loops",
               loop=True, kind=REPETITION),
    ReasonCode("phrase_loop", "hard", "a multi-word phrase repeated back to back", "loops",
               loop=True, kind=REPETITION),
    ReasonCode("line_loop", "hard", "the same line (or group of lines) repeated back to back, or one item under "
               "list numbers in a row (`3. Take breaks.` `4. Take breaks.` …) into the token limit (5+) or 12+",
               "loops",
               loop=True, kind=REPETITION),
    ReasonCode("repeated_ngram", "hard/soft", "a phrase recurring with only a counter changing (`1. X. 2. X. 3. X.`)",
               "loops", loop=True, kind=REPETITION),
    ReasonCode("compression_ratio", "soft", "zlib finds the text far more repetitive (or noisier) than language",
               "loops", loop=True, kind=REPETITION),
    ReasonCode("script_mix", "hard/soft", "a script the prompt does not use (CJK inside English), or homoglyphs; "
               "without a prompt, a script other than the text's main one, read from its prose (code and TeX left "
               "out, a Han, kana or Hangul character weighing as three letters)",
               "scripts", kind="another writing system"),
    ReasonCode("template_leak", "hard",
               "chat-template tokens (`<\\|im_start\\|>`, `<\\|endoftext\\|>`, `</s>`, `[INST]`, `[TOOL_CALLS]`), "
               "or gpt-oss "
               "channel names glued to the text once they are stripped (`assistantfinal`)", "leaks",
               kind="chat-template tokens"),
    ReasonCode("role_leak", "hard/soft",
               "turn markers (`user:`, `# user:`, `Human:`, `### Instruction:`, `assistant`)", "leaks",
               kind="role/turn markers"),
    ReasonCode("thinking_leak", "hard",
               "`<think>`/`</think>` in the answer when thinking is off, separated, or repeated", "thinking",
               kind="think tags"),
    ReasonCode("unterminated_think", "hard/info", "a `<think>` block that never closes (info when cut by length)",
               "thinking", kind="an unclosed think block"),
    ReasonCode("degenerate_enumeration", "hard", "list markers that never advance and hold nothing (`1. 1. 1.`)",
               "hollow", loop=True, kind=REPETITION),
    ReasonCode("empty_list", "hard",
               "lines holding only a list marker or punctuation, repeated (`-`, `•`, `。`), or markers counting "
               "on with nothing in them (`1. 2. 3. 4.`)", "hollow", loop=True, kind=REPETITION),
    ReasonCode("punct_run", "hard", "one punctuation mark over and over (`,,,,,`, `。。。。。。`, `. . . . . . . .`)",
               "hollow", loop=True, kind=REPETITION),
    ReasonCode("glued_repeat", "hard", "a word repeated with no separator (`WordWordWordWord`, any script)",
               "stutter", loop=True, kind=REPETITION),
    ReasonCode("doubled_words", "hard",
               "words or short spans said twice back to back, again and again (`the the cat cat sat sat`, "
               "`is scattered is scattered by`, `所所以`): a round's tokens written twice", "stutter",
               loop=True, kind=REPETITION),
    ReasonCode("word_salad", "hard/soft",
               "pieces of words cut at the wrong places and glued (`ofthe`, `conv ert ed`): far more words "
               "outside the language's lexicon than its text has; or words run together with no spaces "
               "(`Theskylooksblue`)", "salad", kind="word salad"),
    ReasonCode("replacement_char", "hard", "U+FFFD replacement characters (broken byte-level decoding)", "content",
               kind="broken bytes (U+FFFD)"),
    ReasonCode("control_chars", "hard", "C0/C1 control characters, lone surrogates or non-characters", "content",
               kind="control characters"),
    ReasonCode("mojibake", "hard/soft", "UTF-8 decoded with the wrong codec (`Ã©tÃ©` for `été`), found with ftfy",
               "encoding", kind="mis-decoded text"),
    ReasonCode("token_pieces", "hard",
               "tokenizer pieces left undecoded (`ĠThe Ġsky`, `▁The▁sky`, `<0x0A>`): the server returned token "
               "strings, not text (3+, or one glued to a word)", "encoding", kind="undecoded token pieces"),
    ReasonCode("escaped_text", "hard",
               "text escaped twice: a literal `\\n` for line breaks, `\\u5929` for characters, or HTML "
               "entities (`It&#39;s`) in prose (a proxy or server encoding JSON or HTML twice)", "encoding",
               kind="doubly escaped text"),
    ReasonCode("low_likelihood", "hard/soft",
               "`--score-with`: a reference model finds the answer (or a stretch of it) far less likely than "
               "language (mean surprisal, worst span)", "likelihood", kind="text the model finds unlikely"),
    ReasonCode("not_greedy", "hard",
               "`--score-with` the deployment's own weights at T=0: a token that is not the target's argmax "
               "(first position, top-2 gap)", "likelihood"),
    ReasonCode("truncated", "info", "cut at max_tokens (`finish_reason=length`); never garbage by itself",
               "stops"),
)

REASON_CODES: tuple[str, ...] = tuple(r.code for r in REGISTRY)
LOOP_CODES: frozenset[str] = frozenset(r.code for r in REGISTRY if r.loop)
BY_CODE: dict[str, ReasonCode] = {r.code: r for r in REGISTRY}

# The signal families, in the order their reasons are reported (see the module docstring): the
# families that read every text first, then those that read the answer or the whole reply.
FAMILIES = (content, encoding, leaks, hollow, stutter, salad, loops, scripts, stops, thinking)
DETECTORS: tuple[Detector, ...] = tuple(d for family in FAMILIES for d in family.DETECTORS)


@cache
def detectors(*scopes: str) -> tuple[Detector, ...]:
    """The detectors that read one of ``scopes``, in family order."""
    unknown = set(scopes) - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown scope(s) {sorted(unknown)}")
    return tuple(d for d in DETECTORS if scope_of(d) in scopes)


def readme_table() -> str:
    """The README's reason-code table (a test keeps the README equal to it)."""
    lines = ["| code | severity | what it means |", "|---|---|---|"]
    lines += [f"| `{r.code}` | {r.severity} | {r.meaning} |" for r in REGISTRY]
    return "\n".join(lines)
