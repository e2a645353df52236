"""`lifecycle boot` under torchrun, as the tests start it: a real agent and its rank processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun_boot(
    cwd: Path, processes: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node PROCESSES -m lifecycle boot ARGS` in `cwd`, with
    `env` added to the environment, to its exit (bounded by 180 s)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(processes), "-m", "lifecycle", "boot", *args],
        cwd=cwd, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )  # fmt: skip
