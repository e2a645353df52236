"""The host's keeper of finished weights, with real keeper and rank processes
(docs/keeper.md): a startup attaches to what an earlier one gave it, holds the fixed
request's output to the reference before ready, and loads from disk, journaled, whenever the
keeper is missing, mute, foreign, full or tampered with."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lifecycle.core.format.events import (
    AttachRejected,
    ReferenceOutput,
    StoredEvent,
    WeightsKept,
    WeightsPath,
)
from lifecycle.store.journal import Journal
from lifecycle.store.keeperlog import keeper_rows
from tests.conftest import Completed, one_clear_line
from tests.support.keeper import key_env, running_keeper

BOOT = (
    "boot", "--model", "micro-video", "--db", "j.db", "--log-level", "warning",
    "--smoke-request", "off",
)  # fmt: skip


def runs_of(db: Path) -> list[list[StoredEvent]]:
    """Each run's events of rank 0, oldest run first."""
    journal = Journal.open_for_read(str(db))
    try:
        runs = sorted(journal.runs(), key=lambda r: r.created_at)
        return [list(journal.read(run_id=r.run_id, rank=0)) for r in runs]
    finally:
        journal.close()


def one(events: list[StoredEvent], kind: type) -> list:  # type: ignore[type-arg]
    return [e.event for e in events if isinstance(e.event, kind)]


def test_a_second_startup_attaches_to_the_weights_the_first_gave_the_keeper(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The first startup loads from disk and gives its weights to the keeper, journaling the
    fixed request's output as the reference; the second attaches, matches that reference, and
    the keeper journals what it held and handed."""
    env = key_env()
    with running_keeper(tmp_path, env) as keeper:
        for _ in range(2):
            done = lifecycle_cli(*BOOT, "--keeper", str(keeper.socket), env=env)
            assert done.returncode == 0, done.stderr
        assert keeper.stop() == 0
    first, second = runs_of(tmp_path / "j.db")
    (loaded,) = one(first, WeightsPath)
    assert loaded.path == "load" and loaded.reason == "the keeper does not hold this weights key"
    assert [k.outcome for k in one(first, WeightsKept)] == ["kept"]
    (new,) = one(first, ReferenceOutput)
    assert new.outcome == "new"
    (attached,) = one(second, WeightsPath)
    assert attached.path == "attach" and attached.bytes == loaded.bytes > 60 * 2**20
    (matched,) = one(second, ReferenceOutput)
    assert (matched.outcome, matched.checksum) == ("matched", new.checksum)
    assert matched.since_run == first[0].run_id
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    try:
        whats = [r.what for r in reversed(keeper_rows(journal))]
    finally:
        journal.close()
    assert whats == ["started", "holds", "handed", "stopped"]


def _blob_fd(pid: int) -> Path:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if "lifecycle-weights" in os.readlink(fd):
            return fd
    raise AssertionError("the keeper holds no weights file")


def test_weights_changed_in_the_keeper_are_caught_and_loaded_from_disk(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Weights overwritten in the keeper's memory attach (their skeleton is intact) but do not
    reproduce the reference: the startup rejects them, the keeper drops them, and the rank
    loads from disk and matches the reference before it is ready."""
    env = key_env()
    with running_keeper(tmp_path, env) as keeper:
        assert lifecycle_cli(*BOOT, "--keeper", str(keeper.socket), env=env).returncode == 0
        with _blob_fd(keeper.proc.pid).open("r+b") as blob:
            size = blob.seek(0, os.SEEK_END)
            blob.seek(0)
            blob.write(b"\x3f" * size)
        done = lifecycle_cli(*BOOT, "--keeper", str(keeper.socket), env=env)
        assert done.returncode == 0, done.stderr
        assert keeper.status()["held"] == []
    first, second = runs_of(tmp_path / "j.db")
    (rejected,) = one(second, AttachRejected)
    assert rejected.what == "the output of the fixed request differs from the reference"
    assert rejected.expected == one(first, ReferenceOutput)[0].checksum != rejected.observed
    assert [(p.path, p.reason) for p in one(second, WeightsPath)] == [
        ("attach", None),
        ("load", "attach rejected: output differs"),
    ]
    assert [r.outcome for r in one(second, ReferenceOutput)] == ["matched"]


@pytest.fixture
def mute_keeper(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A socket of the user's own that accepts and either answers garbage or nothing."""
    folder = tmp_path / "mute"
    folder.mkdir(mode=0o700)
    path = folder / "k.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(8)
    behaviour = ["garbage"]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if behaviour[0] == "garbage":
                conn.recv(65536)  # the request, then garbage for an answer
                conn.sendall(b"\x00\x00\x00\x05hello")
                conn.close()
            else:
                held.append(conn)  # never answers

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path, behaviour
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_a_keeper_that_answers_garbage_or_nothing_is_loaded_past_in_bounded_time(
    tmp_path: Path,
    lifecycle_cli: Callable[..., Completed],
    mute_keeper: tuple[Path, list[str]],
) -> None:
    """A keeper socket that answers garbage, or nothing within the keeper timeout: the rank
    loads from disk with one warning, journaled, and is ready."""
    path, behaviour = mute_keeper
    env = key_env()
    reasons = []
    for answer in ("garbage", "silence"):
        behaviour[0] = answer
        started = time.monotonic()
        done = lifecycle_cli(*BOOT, "--keeper", str(path), env=env)
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - started < 120
        warned = [line for line in done.stderr.splitlines() if "keeper_unavailable" in line]
        assert len(warned) == 1
        reasons.append(one(runs_of(tmp_path / "j.db")[-1], WeightsPath)[0].reason)
    assert "answered garbage" in reasons[0]
    assert "answered too slowly" in reasons[1]


def test_no_keeper_anywhere_loads_from_disk_quietly_and_a_named_one_missing_is_warned(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--keeper auto with no keeper listening loads without a word; a --keeper PATH with
    nothing there loads with one warning; --keeper off asks no keeper at all."""
    env = {**key_env(), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    auto = lifecycle_cli(*BOOT, env=env)
    named = lifecycle_cli(*BOOT, "--keeper", str(tmp_path / "none.sock"), env=env)
    off = lifecycle_cli(*BOOT, "--keeper", "off", env=env)
    assert [r.returncode for r in (auto, named, off)] == [0, 0, 0]
    assert "keeper" not in auto.stderr and "keeper" not in off.stderr
    assert named.stderr.count("keeper_unavailable") == 1
    reasons = [one(run, WeightsPath)[0].reason for run in runs_of(tmp_path / "j.db")]
    assert reasons == [
        f"no keeper at {tmp_path / 'run' / 'lifecycle' / 'keeper.sock'}",
        f"keeper {tmp_path / 'none.sock'}: no keeper at {tmp_path / 'none.sock'}",
        "--keeper off",
    ]


def test_a_keeper_at_its_budget_refuses_and_the_startup_goes_on(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Weights larger than the keeper's budget are refused in one journaled line on each side;
    the startup is ready on its own weights."""
    env = key_env()
    with running_keeper(tmp_path, env, budget="1MiB") as keeper:
        done = lifecycle_cli(*BOOT, "--keeper", str(keeper.socket), env=env)
        assert done.returncode == 0, done.stderr
    (kept,) = one(runs_of(tmp_path / "j.db")[0], WeightsKept)
    assert kept.outcome == "refused" and "would pass the budget" in (kept.reason or "")
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    try:
        assert "refused" in [r.what for r in keeper_rows(journal)]
    finally:
        journal.close()


def test_a_keeper_under_another_key_is_not_believed(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Ranks holding another key than the keeper's: the keeper refuses their requests and
    they cannot verify its answers; they load from disk, journaled."""
    with running_keeper(tmp_path, key_env()) as keeper:
        done = lifecycle_cli(*BOOT, "--keeper", str(keeper.socket), env=key_env())
        assert done.returncode == 0, done.stderr
        assert keeper.status()["held"] == []
    (path,) = one(runs_of(tmp_path / "j.db")[0], WeightsPath)
    assert path.path == "load"
    assert "signature that does not verify" in (path.reason or "")


def test_the_keeper_socket_is_its_users_alone_and_one_keeper_listens(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The socket is mode 0600 in a folder of mode 0700; a second keeper on it is refused in
    one line; a keeper killed without stopping is journaled as lost by the next keeper of its
    socket, once, and a keeper of another socket started meanwhile journals no loss."""
    env = key_env()
    with running_keeper(tmp_path, env) as keeper:
        with running_keeper(tmp_path, env, folder="beside") as beside:
            beside.stop()
        assert stat.S_IMODE(keeper.socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(keeper.socket.parent.stat().st_mode) == 0o700
        again = lifecycle_cli("keeper", "--socket", str(keeper.socket), "--db", "j.db", env=env)
        assert again.returncode == 2
        assert "a keeper already listens there" in one_clear_line(again)
        killed = keeper.proc.pid
        keeper.proc.kill()
        keeper.proc.wait(timeout=30)
    with running_keeper(tmp_path, env) as keeper:
        keeper.stop()
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    try:
        lost = [r for r in keeper_rows(journal) if r.what == "lost"]
    finally:
        journal.close()
    assert len(lost) == 1 and lost[0].keeper_pid == keeper.proc.pid
    assert f"keeper pid {killed} ended without stopping" in (lost[0].detail or "")


def test_bad_keeper_options_are_one_line(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A budget that is not a size, and --status with no keeper: one line each, no traceback."""
    env = key_env()
    bad = lifecycle_cli("keeper", "--memory-budget", "lots", "--db", "j.db", env=env)
    assert bad.returncode == 2 and "--memory-budget 'lots'" in one_clear_line(bad)
    status = lifecycle_cli("keeper", "--status", "--socket", str(tmp_path / "x.sock"), env=env)
    assert status.returncode == 1 and "no keeper at" in status.stdout
    assert "Traceback" not in status.stderr
