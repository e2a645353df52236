"""`lifecycle serve` as the tests run it: a real server on a free loopback port, in front of
real ranks, in a test's tmp_path, killed at the end whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from lifecycle.core.format.events import StoredEvent
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.store.journal import Journal


class Served:
    """A running `lifecycle serve`: its process, its URL, its journal and a client of it."""

    def __init__(self, proc: subprocess.Popen[str], url: str, db: Path) -> None:
        self.proc, self.url, self.db = proc, url, db
        self.client = httpx.Client(base_url=url, timeout=60.0)

    def get(self, path: str) -> httpx.Response | None:
        """GET `path`, or None while the server does not answer."""
        try:
            return self.client.get(path)
        except httpx.TransportError:
            return None

    def wait_for(self, path: str, want: int, *, within: float) -> list[int]:
        """Poll GET `path` until it answers `want`; return every status seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode} before {path} {want}")
            response = self.get(path)
            if response is not None:
                seen.append(response.status_code)
                if response.status_code == want:
                    return seen
            time.sleep(0.1)
        raise AssertionError(f"{path} never answered {want}; saw {seen[-5:]}")

    def wait_for_health(self, want: int, *, within: float) -> list[int]:
        """Poll /health until it answers `want`; return every status seen on the way."""
        return self.wait_for("/health", want, within=within)

    def stop(self) -> int:
        """SIGTERM the server; its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.client.close()


@contextlib.contextmanager
def serve(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """`lifecycle serve --model micro-video` with `extra` options in `tmp_path` (journal
    j.db, output in serve.log), killed on the way out if it still runs."""
    port = free_port()
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "serve", "--model", "micro-video",
             "--db", "j.db", "--port", str(port), "--log-level", "warning", *extra],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        )  # fmt: skip
        served = Served(proc, f"http://127.0.0.1:{port}", tmp_path / "j.db")
        try:
            yield served
        finally:
            served.client.close()  # also when the test failed before stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def journal_events(db: Path) -> list[StoredEvent]:
    """Every event of the one run journaled in `db`, in (rank, seq) order."""
    journal = Journal.open_for_read(str(db))
    try:
        (run,) = journal.runs()
        return list(journal.read(run_id=run.run_id))
    finally:
        journal.close()
