"""The reference server: an OpenAI-compatible HTTP server over the in-process engine."""
