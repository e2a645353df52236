"""Shared fixtures: journals in tmp_path, and the command line run as a real subprocess."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.otlp import Receiver

REPO = Path(__file__).resolve().parent.parent
# Three pytest-xdist workers share two cores, and most tests start rank processes of their own:
# each process runs torch on one thread (a rank given OMP_NUM_THREADS keeps it), so that none
# spins waiting for a core another holds. A test that needs another count sets it itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The default keeper socket (--keeper auto) is under XDG_RUNTIME_DIR: the tests' own, empty, so
# that a keeper the developer runs is never attached to by a test that did not start one.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="lifecycle-tests-run-")


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    module: str,
    args: Sequence[str],
    *,
    cwd: Path,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> Completed:
    """Run `python -m module args...`, after the command `prefix` if one is given, to
    completion, bounded by `timeout` seconds."""
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", module, *args],
        cwd=cwd, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return Completed(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def lifecycle_cli(tmp_path: Path) -> Callable[..., Completed]:
    def run(*args: str, timeout: float = 240.0, env: dict[str, str] | None = None) -> Completed:
        return run_cli("lifecycle", args, cwd=tmp_path, timeout=timeout, env=env)

    return run


def one_clear_line(result: Completed) -> str:
    """The one line a refused command printed on stderr, with no traceback."""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def assert_refused_before_start(result: Completed, message: str, db: Path) -> None:
    """The command was refused before anything started: exit 2, one clear line holding
    `message`, and no journal at `db`."""
    assert result.returncode == 2
    assert message in one_clear_line(result)
    assert not db.exists()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_newer_journal(path: Path, revision: str = "0999_future") -> None:
    """A journal of this lifecycle whose recorded schema revision is one it does not know."""
    from lifecycle.store.journal import Journal

    Journal.open_for_write(str(path)).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    conn.commit()
    # Fold the WAL into the file and close: a connection left to the garbage collector would
    # checkpoint later, changing the bytes in the middle of the test.
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def processes_in(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is `directory` (rank processes of a
    test inherit its tmp_path)."""
    found = []
    target = str(directory.resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") == target:
                state = (entry / "stat").read_text().split(") ")[-1][:1]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def no_leftover_processes(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Fail the test if a process it started outlives it; kill any such process."""
    yield
    leftovers = processes_in(tmp_path)
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert leftovers == [], f"processes outlived the test: {leftovers}"


def as_unprivileged() -> list[str]:
    """A command prefix under which file permissions apply to the command.

    As root, permission bits are ignored only through the DAC capabilities: dropped from the
    bounding set, root is held to the owner bits of the files it made, as any user is. (A
    switch to `nobody` would need the interpreter readable by it, which a venv under /root is
    not.)
    """
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): permissions cannot apply")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def run_unprivileged(cwd: Path, module: str, *args: str) -> Completed:
    return run_cli(module, args, cwd=cwd, timeout=180, prefix=as_unprivileged())


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """Kill `proc` on leaving the block if it is still running, pass or fail."""
    try:
        yield proc
    finally:
        proc.kill()  # a no-op once it has exited (Popen polls before it signals)
        proc.wait(timeout=10)


def wait_until(condition: Callable[[], bool], *, within: float, what: str) -> None:
    """Poll `condition` every 0.1 s; fail the test if it does not hold within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {within} s: {what}")


@pytest.fixture(scope="session")
def postgres():  # type: ignore[no-untyped-def]
    """A real PostgreSQL server for the session (see tests/pg.py), stopped at the end."""
    from tests.pg import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A real OTLP/HTTP trace receiver (see tests/otlp.py) for the test's duration."""
    from tests.otlp import otlp_receiver

    with otlp_receiver() as found:
        yield found


@pytest.fixture
def models_forgotten(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The models a test registers, forgotten after it."""
    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.runtime import pipeline as runtime_pipeline

    presets = dict(MODEL_PRESETS)
    monkeypatch.setattr(runtime_pipeline, "_FACTORIES", dict(runtime_pipeline._FACTORIES))
    yield
    MODEL_PRESETS.clear()
    MODEL_PRESETS.update(presets)


def bash_completions(script: str, words: Sequence[str], *, cwd: Path) -> list[str]:
    """What bash offers after `words` (the last one being typed) with `script` sourced: the
    completion function shtab wrote for the command, called as bash calls it."""
    command = words[0]
    line = " ".join(words)
    sourced = cwd.parent / f"{command}-completion.bash"  # beside, not among, the files offered
    sourced.write_text(script, encoding="utf-8")
    driver = (
        f"source {shlex.quote(str(sourced))}\n"
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\nCOMP_LINE={shlex.quote(line)}\nCOMP_POINT=${{#COMP_LINE}}\n"
        f"_shtab_{command} {command} {shlex.quote(words[-1])} {shlex.quote(words[-2])}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "-c", driver], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    return sorted(line for line in done.stdout.splitlines() if line)
