"""Plain OpenAI-compatible servers: no spec numbers, client timings only."""

from __future__ import annotations

from ddtree_diag.backends.dialects.base import Dialect


class OpenAI(Dialect):
    name = "openai"
    description = "plain OpenAI-compatible: chat_template_kwargs (dropped on a 400 naming it); no spec numbers"
    budget_knob = "not per request (the server speculates as configured, if at all)"
    detect_order = 1000
