"""Running code in a fresh Python process, for what a process does once (imports, calibrations)."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, timeout: float = 300) -> str:
    """The standard output of ``python -c code`` in a new interpreter; fails the test, with the
    end of its standard error, if it does not exit cleanly."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
