"""The tree budget: what one number on the wire means, and how far it may go.

A case's ``tree_budget`` is ``None`` ("default": nothing is sent, the server or engine uses its
own), ``0`` (plain autoregressive decoding through the same loop: the budget0 baseline), or
``N > 0`` (a draft tree of at most N nodes per verify round; a chain server reads it as its draft
length). ``MAX_TREE_BUDGET`` is the reference server's schema ceiling and the range of
``serve --max-tree-budget``; a CPU server caps requests lower by default (``CPU_MAX_TREE_BUDGET``).

Pure and light (no httpx, no torch): the matrix, the backends, the lossless check, the server and
the ``serve`` command all read their budget rules from here (how a budget reads in case ids and
tables is ``records.budget_label``).
"""

from __future__ import annotations

from typing import Any

from ddtree_diag.errors import UsageError

AR_BUDGET = 0  # no draft: the target alone, one token per round
MAX_TREE_BUDGET = 4096  # the largest budget any request or serve flag may name
CPU_MAX_TREE_BUDGET = 256  # serve's default cap on CPU (a 4096-node tree there takes minutes)
DEFAULT_WORDS = ("default", "none", "server")  # what --budget / a matrix accepts for None


def parse_budget(value: Any, where: str = "--budget") -> int | None:
    """A budget as a flag or a matrix writes it: an integer >= 0, or one of DEFAULT_WORDS (None).
    No ceiling here: a remote server may take more than the reference server's."""
    if isinstance(value, str) and value.strip().lower() in DEFAULT_WORDS:
        return None
    try:
        budget = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: expected an integer >= 0 or 'default', got {value!r}") from None
    if isinstance(value, bool) or budget < 0 or str(budget) != str(value).strip():
        raise UsageError(f"{where}: expected an integer >= 0 or 'default', got {value!r}")
    return budget


def resolve(requested: int | None, default: int) -> int:
    """The budget a decoder uses: the request's own, else the server's or engine's default."""
    return default if requested is None else requested


def server_default(engine_default: int, limit: int) -> int:
    """The budget a server applies to requests that send none: the engine's, within its limit."""
    return min(int(engine_default), limit)


def check_serve_flags(default: int | None, limit: int | None) -> None:
    """``serve --tree-budget`` (the default for requests that send none) and ``--max-tree-budget``
    (its ceiling): both >= 0, the ceiling at most MAX_TREE_BUDGET, the default within it."""
    if default is not None and default < 0:
        raise UsageError("--tree-budget must be >= 0")
    if limit is not None and not 0 <= limit <= MAX_TREE_BUDGET:
        raise UsageError(f"--max-tree-budget must be in 0-{MAX_TREE_BUDGET}")
    if limit is not None and default is not None and default > limit:
        raise UsageError(f"--tree-budget {default} is over --max-tree-budget {limit}")


def check_default_within(default: int | None, limit: int) -> None:
    """``serve --tree-budget`` against the ceiling the server resolved (its device's default)."""
    if default is not None and default > limit:
        raise UsageError(f"--tree-budget {default} is over the limit {limit} (--max-tree-budget)")


def over_limit(budget: int | None, limit: int) -> str | None:
    """Why a request's budget is refused by a server with this ceiling; None when it fits."""
    if budget is None or budget <= limit:
        return None
    return f"tree_budget {budget} exceeds this server's limit {limit} (serve --max-tree-budget)"


def overrun(budget: int | None, spec: Any) -> str | None:
    """Why a request's own speculation numbers show more drafting than the budget it sent allowed
    (the server does not honour a per-request budget), or None: within it, nothing sent, or
    numbers that cannot tell (none, or server-wide counters other traffic moves).

    ``spec`` is a ``records.SpecMetrics``. At budget 0 any drafted or accepted draft token is too
    many. At budget N a round can commit at most N accepted tokens plus its bonus, whatever the
    tree's shape; drafted counts are not compared there (a block draft may propose more tokens
    than the tree keeps). Rounds a server counts one off (the prefill's token) are allowed for, and
    a mean whose rounds are not given is not judged."""
    if budget is None or spec is None or getattr(spec, "server_wide", False):
        return None
    drafted, accepted = spec.draft_tokens or 0, spec.accepted_tokens or 0
    if budget == AR_BUDGET and (drafted > 0 or accepted > 0):
        return f"budget 0 sent, yet {drafted} draft tokens were proposed and {accepted} accepted"
    longest = max(spec.acceptance_lengths or [0])
    if longest > budget + 1:
        return f"budget {budget} sent, yet a round committed {longest} tokens (at most {budget + 1} possible)"
    mean, rounds = spec.mean_acceptance_length, spec.decode_rounds
    # the excess in tokens, where the rounds are known: two or more cannot be a count one off (a
    # mean without its rounds may be a 2-token answer over one counted round)
    if mean is not None and rounds and (mean - budget - 1) * rounds >= 2:
        return (f"budget {budget} sent, yet {mean:.2f} tokens were committed per round "
                f"(at most {budget + 1} possible)")
    return None
