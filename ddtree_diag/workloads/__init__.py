"""Workloads: prompts built for a purpose (long-context fills) rather than written by hand."""
