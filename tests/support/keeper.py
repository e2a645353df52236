"""`lifecycle keeper` as the tests run it: a real keeper process on a socket in the test's
tmp_path, with a key of the test's own, stopped at the end whatever happened."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.runtime.keeping.keeperwire import KeeperKey, ask


def key_env() -> dict[str, str]:
    """An artifact key of the test's own, for the keeper and the ranks alike."""
    return {"LIFECYCLE_ARTIFACT_KEY": secrets.token_hex(32), "PYTHONWARNINGS": "ignore"}


@dataclass
class RunningKeeper:
    proc: subprocess.Popen[str]
    socket: Path
    env: dict[str, str]
    log: Path

    def status(self) -> dict[str, Any]:
        key = KeeperKey.derived(self.env["LIFECYCLE_ARTIFACT_KEY"].encode())
        answer, fds = ask(self.socket, key, {"op": "status"})
        for fd in fds:
            os.close(fd)
        return answer

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@contextlib.contextmanager
def running_keeper(
    tmp_path: Path,
    env: dict[str, str],
    *,
    budget: str = "1GiB",
    db: str = "j.db",
    folder: str = "keeper",
) -> Iterator[RunningKeeper]:
    """A keeper on `tmp_path`/`folder`/k.sock journaling into `db`, ready to answer."""
    sock = tmp_path / folder / "k.sock"
    log = tmp_path / f"{folder}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "keeper", "--socket", str(sock), "--db", db,
             "--memory-budget", budget],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **env},
        )  # fmt: skip
    keeper = RunningKeeper(proc=proc, socket=sock, env=env, log=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the keeper exited {proc.returncode}: {log.read_text()}")
            try:
                keeper.status()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield keeper
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
