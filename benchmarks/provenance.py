"""Where a benchmark figure comes from: the machine and the commit, stamped on every row."""

from __future__ import annotations

import os
import platform
import subprocess


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cpus | Python {platform.python_version()}"


def commit() -> str:
    """Short hash of HEAD, with "-dirty" if tracked files differ from it, results aside (a
    benchmark's own rows, appended by an earlier run, do not change what is measured).
    ``DTR_COMMIT`` overrides it where the checkout's git metadata is missing or not the code's
    (a copy of the working tree sent to a GPU machine kept the session's first HEAD)."""
    if os.environ.get("DTR_COMMIT"):
        return os.environ["DTR_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                ":(top,exclude)benchmarks/results"], capture_output=True, text=True)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
