"""A process that imports lifecycle (and torch) once, then forks one `lifecycle` command per
request: the same entry point as the console script, without paying the import each time.

Protocol, one JSON object per line: stdin takes {"argv": [...], "cwd": "..."}; stdout answers
{"started": pid} in request order, and {"exited": pid, "code": status} when a child ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

EXIT_TIMEOUT_S = 180.0


def _reap(out: IO[str], lock: threading.Lock) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.02)  # no child yet: nothing to reap
            continue
        with lock:
            out.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()


def serve() -> None:
    import lifecycle.serve.cli.main
    import lifecycle.serve.launch.launcher

    out = sys.stdout
    lock = threading.Lock()
    threading.Thread(target=_reap, args=(out, lock), daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.chdir(request["cwd"])
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            status = 1
            try:
                status = lifecycle.serve.cli.main.main(request["argv"])
            finally:
                os._exit(status)
        with lock:
            out.write(json.dumps({"started": pid}) + "\n")
            out.flush()


class Zygote:
    """The client side: start commands in the zygote and learn when they end."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            cwd=Path(__file__).resolve().parent.parent,
        )
        self._request_lock = threading.Lock()
        self._state = threading.Condition()
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message: dict[str, Any] = json.loads(line)
            with self._state:
                if "started" in message:
                    self._started.append(int(message["started"]))
                else:
                    self._exited[int(message["exited"])] = int(message["code"])
                self._state.notify_all()

    def start(self, argv: list[str], *, cwd: Path) -> Forked:
        with self._request_lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd)}) + "\n")
            self._proc.stdin.flush()
            with self._state:
                if not self._state.wait_for(lambda: bool(self._started), timeout=60):
                    raise RuntimeError("the zygote did not start the command")
                return Forked(self, self._started.pop(0))

    def exit_code(self, pid: int, *, timeout: float | None) -> int | None:
        with self._state:
            self._state.wait_for(lambda: pid in self._exited, timeout=timeout)
            return self._exited.get(pid)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.kill()
        self._proc.wait(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


class Forked:
    """One forked command, with the parts of the Popen interface the crash loop uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        return self._zygote.exit_code(self.pid, timeout=0)

    def wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        code = self._zygote.exit_code(self.pid, timeout=timeout)
        if code is None:
            raise TimeoutError(f"pid {self.pid} did not end within {timeout} s")
        return code

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            return


if __name__ == "__main__":
    serve()
