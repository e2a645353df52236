"""Worker processes of a benchmark: start them once, release them together round by round,
and collect one JSON result from each per round."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.suite import BenchError

REPO = Path(__file__).resolve().parent.parent
READY = "ready"
GO = "go"

# A worker's task: given a round's payload it prepares (outside any timing) and returns the
# work to run once released, which returns the round's JSON result.
Task = Callable[[dict[str, Any]], Callable[[], dict[str, Any]]]


class Worker:
    """`python -m MODULE`, speaking one JSON or keyword line at a time on stdin and stdout.

    Protocol: the worker prints `ready` once imported; then per round it reads a payload,
    prepares, prints `ready`, waits for `go`, works and prints its result. Its stderr goes to
    a file, quoted when it fails.
    """

    def __init__(self, module: str, *, stderr_path: Path) -> None:
        self.module = module
        self.stderr_path = stderr_path
        self._buffer = b""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *_pythonpath()])}
        with stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=REPO,
                env=env,
            )

    def read_line(self, deadline: float) -> str:
        """The worker's next line; BenchError when it exits or the deadline passes first."""
        stdout = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.module} worker timed out: {self.stderr_tail()}")
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait(timeout=10.0)
                raise BenchError(f"{self.module} worker exited {code}: {self.stderr_tail()}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode().strip()

    def expect(self, word: str, deadline: float) -> None:
        line = self.read_line(deadline)
        if line != word:
            raise BenchError(f"{self.module} worker said {line[:200]!r}, expected {word!r}")

    def send(self, line: str) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.module} worker went away: {self.stderr_tail()}") from None

    def result(self, deadline: float) -> dict[str, Any]:
        line = self.read_line(deadline)
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise BenchError(f"{self.module} worker printed {line[:200]!r}")
        return doc

    def close(self) -> None:
        """Ask it to exit (end of stdin), then kill it if it has not within 10 s."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stderr_tail(self) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip()
        except OSError:
            return "(no stderr)"
        return text.splitlines()[-1][:300] if text else "(no stderr)"


class Pool(contextlib.AbstractContextManager["Pool"]):
    """Worker processes started once and reused for every round; closed on exit."""

    def __init__(self, module: str, *, size: int, workdir: Path, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.workers: list[Worker] = []
        try:
            for index in range(size):
                stem = f"{module.rsplit('.', 1)[-1]}-worker-{index}"
                self.workers.append(Worker(module, stderr_path=workdir / f"{stem}.stderr"))
            deadline = time.monotonic() + timeout_s
            for worker in self.workers:
                worker.expect(READY, deadline)
        except BaseException:
            self.close()
            raise

    def round(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give the first len(payloads) workers one payload each, wait until all are prepared,
        release them together and collect their results, all within the pool's timeout."""
        deadline = time.monotonic() + self.timeout_s
        workers = self.workers[: len(payloads)]
        if len(workers) < len(payloads):
            raise BenchError(f"a round of {len(payloads)} in a pool of {len(self.workers)}")
        for worker, payload in zip(workers, payloads, strict=True):
            worker.send(json.dumps(payload))
        for worker in workers:
            worker.expect(READY, deadline)
        for worker in workers:
            worker.send(GO)
        return [worker.result(deadline) for worker in workers]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop_groups(procs: Sequence[subprocess.Popen[Any]], *, within_s: float = 60.0) -> None:
    """Stop processes each started in a session of its own, with whatever they started: SIGTERM
    each one's process group, wait up to `within_s` for each, and SIGKILL the group of any
    still running then."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def serve(task: Task) -> None:
    """The worker's side of the protocol, until its stdin ends."""
    print(READY, flush=True)
    for line in sys.stdin:
        work = task(json.loads(line))
        print(READY, flush=True)
        if sys.stdin.readline().strip() != GO:
            raise SystemExit("bench worker: the parent went away before go")
        print(json.dumps(work()), flush=True)


def _pythonpath() -> list[str]:
    existing = os.environ.get("PYTHONPATH", "")
    return [p for p in existing.split(os.pathsep) if p]
