"""Load a page in a real headless Chromium (the Debian package ``chromium``) and report what it
logged to its console.

Chromium runs with a fresh profile and the flags a closed CI machine needs (no background
networking, no sync, no component updates). ``--dump-dom`` prints the DOM after the page has
loaded; ``--enable-logging=stderr`` makes every console message of the page (script errors, CSP
violations, failed loads, console.error) a ``CONSOLE`` line on stderr.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
CONSOLE_LINE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\] (.*)$")
MISSING = "Chromium is not installed (Debian package `chromium`; .ci/run installs it for CI)"


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Page:
    dom: str
    console: list[str]  # every message the page logged (errors, CSP violations, warnings)
    returncode: int


def load(path: Path, timeout: float = 90) -> Page:
    """Open ``path`` (a local file) in headless Chromium; the DOM after load and the console."""
    binary = chromium()
    if binary is None:
        raise RuntimeError(MISSING)
    with tempfile.TemporaryDirectory(prefix="ddtree-chromium-") as profile:
        done = subprocess.run(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", path.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout,
        )
    console = [m.group(1) for line in done.stderr.splitlines() if (m := CONSOLE_LINE.search(line))]
    return Page(done.stdout, console, done.returncode)
