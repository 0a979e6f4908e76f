"""Checks over finished results: quality (garbage text, per case), lossless (a case against its
non-speculative baseline), findings (rules over the whole run) and the gate (thresholds).

Each returns a typed record from ``ddtree_diag.records`` (Verdict, BaselineComparison, Finding,
GateResult) and sees results only, never command-line options.
"""
