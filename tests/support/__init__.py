"""Helpers the tests share: processes, the stand-in and hostile servers, fixtures and generators."""
