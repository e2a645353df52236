"""Python code run in a fresh interpreter, as the tests that need a clean `sys.modules`, a
process of its own or limits of its own run it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_python(
    code: str,
    *args: str,
    timeout: float = 60.0,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -c code args...` with this interpreter to completion, bounded by `timeout`
    seconds, in this process's environment plus `env`; what it wrote, as text. With `check`, an
    exit other than 0 raises CalledProcessError."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=timeout, check=check,
    )  # fmt: skip
