"""Rank processes under the environment torchrun sets: what cannot be right is refused at
start, a rank waiting at the rendezvous answers a signal, and ranks started with different
settings all stop at the rendezvous, saying what differs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifecycle.core.format.events import Error, RunStarted, Shutdown, StoredEvent
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.store.journal import Journal
from tests.conftest import Completed, one_clear_line, reaped, run_cli, wait_until

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

MICRO = ["boot", "--model", "micro-video", "--db", "j.db", "--log-level", "error"]
# Whatever the environment the tests run in holds of these, each test sets its own.
TORCHRUN_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "LIFECYCLE_RUN_ID",
    "LIFECYCLE_CLOCK_SKEW", "LIFECYCLE_FAULTS", "LIFECYCLE_STORE_KEY", "LIFECYCLE_STORE_KEY_FILE",
)  # fmt: skip
# The store key an operator gives every rank (docs/nodes.md).
STORE_KEY = "5e41ed5a1e5f0bd0" * 4


def rank_env(rank: int, world: int, port: int, **more: str) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of `world` on one host, with the store key
    the operator gives every rank."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_NAMES}
    return {
        **base, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "LIFECYCLE_STORE_KEY": STORE_KEY, **more,
    }  # fmt: skip


@dataclass(frozen=True)
class RankProcess:
    """A rank process, and the file its stderr goes to."""

    proc: subprocess.Popen[str]
    stderr: Path

    def stopped_with(self, *, within: float) -> tuple[int, str]:
        """Its exit status and stderr, once it has exited (within `within` seconds)."""
        status = self.proc.wait(timeout=within)
        return status, self.stderr.read_text()


@contextlib.contextmanager
def rank_process(tmp_path: Path, env: dict[str, str], *flags: str) -> Iterator[RankProcess]:
    """`lifecycle boot` of the micro model as the rank `env` names, its stderr kept in a file
    (a pipe left open by a failing test would be reported against the next one); killed on
    leaving the block if still running."""
    err = tmp_path / f"rank{env['RANK']}.stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", *MICRO, *flags],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True,
        )  # fmt: skip
        with reaped(proc):
            yield RankProcess(proc=proc, stderr=err)


def boot_with(tmp_path: Path, env: dict[str, str], timeout: float = 90) -> Completed:
    """`lifecycle boot` of the micro model in exactly `env` (nothing inherited from the test
    process's own torchrun variables), bounded by `timeout`."""
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle", *MICRO], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


# Each environment, and what its one line says; each is one no torchrun would set.
IMPOSSIBLE = [
    ({"RANK": "3"}, "RANK=3 is outside 0..1 (WORLD_SIZE=2)"),
    ({"RANK": "-1"}, "must be integers (as torchrun sets them), not RANK='-1'"),
    ({"WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "1"}, "WORLD_SIZE=0 is outside 1..64"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside 0..1 (LOCAL_WORLD_SIZE=2)"),
    ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is outside 1..2 (WORLD_SIZE=2)"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is outside 1..65535"),
    ({"LIFECYCLE_CLOCK_SKEW": "1:nan"}, "LIFECYCLE_CLOCK_SKEW='1:nan': 'nan' is not a number"),
    ({"LIFECYCLE_RUN_ID": ".."}, "LIFECYCLE_RUN_ID: '..' is not a run id"),
    ({"LIFECYCLE_RUN_ID": "/tmp/elsewhere"}, "LIFECYCLE_RUN_ID: '/tmp/elsewhere' is not a run id"),
]


@pytest.mark.parametrize(
    ("changes", "said"),
    IMPOSSIBLE,
    ids=["rank-outside-world", "negative-rank", "empty-world", "local-rank-outside",
         "local-world-larger", "port-outside", "skew-nan", "run-id-dotdot", "run-id-absolute"],
)  # fmt: skip
def test_an_impossible_torchrun_environment_is_one_line_and_exit_2(
    tmp_path: Path, changes: dict[str, str], said: str
) -> None:
    """A rank whose torchrun environment cannot be right exits 2 at start with one line
    saying why, before it joins a group or writes anything."""
    started = time.monotonic()
    result = boot_with(tmp_path, rank_env(0, 2, free_port(), **changes))
    assert result.returncode == 2, result.stderr[-2000:]
    assert said in one_clear_line(result)
    assert time.monotonic() - started < 30
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "missing",
    [("RANK",), ("MASTER_ADDR", "MASTER_PORT"), ("RANK", "MASTER_ADDR", "MASTER_PORT")],
    ids=["no-rank", "no-master", "world-size-only"],
)
def test_a_partial_torchrun_environment_is_refused_not_run_as_one_rank(
    tmp_path: Path, missing: tuple[str, ...]
) -> None:
    """Some of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT without the rest is one line
    naming what is missing and exit 2, not a silent world of one rank."""
    result = boot_with(tmp_path, without(rank_env(0, 2, free_port()), *missing))
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_clear_line(result)
    assert "a partial torchrun environment" in line
    assert f"but not {', '.join(missing)}" in line
    assert list(tmp_path.iterdir()) == []


def store_listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.ranks
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_rank_waiting_at_the_rendezvous_for_its_run_id_stops_at_once_on_a_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Rank 0 of two, with no run id in its environment, waits at the rendezvous for a peer
    that never comes; a signal ends it within seconds with 128+N and one line saying that
    nothing could be journaled, not at the rendezvous timeout."""
    port = free_port()
    with rank_process(tmp_path, rank_env(0, 2, port)) as rank:
        # Rank 0 holds the rendezvous store at MASTER_PORT while it waits for rank 1.
        wait_until(lambda: store_listens(port), within=120, what="rank 0 at the rendezvous")
        rank.proc.send_signal(sig)
        status, err = rank.stopped_with(within=15)
    assert status == 128 + int(sig)
    assert one_clear_line(Completed(status, "", err)) == (
        f"lifecycle: rank 0: stopped by {sig.name} before its journal was open (the ranks were"
        " agreeing on a run id): nothing journaled"
    )


def events_by_rank(db: Path) -> dict[int, list[StoredEvent]]:
    with Journal.open_for_read(str(db)) as journal:
        (run,) = journal.runs()
        out: dict[int, list[StoredEvent]] = {}
        for stored in journal.read(run_id=run.run_id):
            out.setdefault(stored.rank, []).append(stored)
    return out


@pytest.mark.ranks
def test_a_rank_waiting_at_the_rendezvous_journals_its_stop_by_signal(tmp_path: Path) -> None:
    """Rank 0 of two, its run named by torchrun's rendezvous id, waits in the rendezvous for a
    peer that never comes; SIGTERM ends it at once with 143, the stop journaled."""
    port = free_port()
    env = rank_env(0, 2, port, TORCHELASTIC_RUN_ID="job-1")
    with rank_process(tmp_path, env) as rank:
        wait_until(lambda: store_listens(port), within=120, what="rank 0 at the rendezvous")
        rank.proc.send_signal(signal.SIGTERM)
        status, _ = rank.stopped_with(within=15)
    assert status == 143
    (stop,) = [e for e in events_by_rank(tmp_path / "j.db")[0] if isinstance(e.event, Shutdown)]
    assert isinstance(stop.event, Shutdown)
    assert (stop.state, stop.event.signal) == ("created", "SIGTERM")


@pytest.mark.ranks
def test_ranks_started_with_different_settings_all_stop_at_the_rendezvous(
    tmp_path: Path,
) -> None:
    """Two ranks under torchrun given different --seed and --warmup-mode: each journals an
    error naming both settings and the ranks holding each value, says so in its last line
    and exits 2 within seconds of the rendezvous; the verdict is a failure, not a hang."""
    port = free_port()
    flags = [["--seed", "1"], ["--seed", "2", "--warmup-mode", "none"]]
    envs = [rank_env(r, 2, port, TORCHELASTIC_RUN_ID="job-2") for r in range(2)]
    with (
        rank_process(tmp_path, envs[0], *flags[0]) as first,
        rank_process(tmp_path, envs[1], *flags[1]) as second,
    ):
        ended = [rank.stopped_with(within=150) for rank in (first, second)]
    said = (
        'the ranks were started with different settings: warmup_mode ("server" on rank 0 vs'
        ' "none" on rank 1); seed (1 on rank 0 vs 2 on rank 1)'
    )
    for rank, (status, err) in enumerate(ended):
        assert status == 2, err[-2000:]
        assert err.strip().splitlines()[-1] == f"lifecycle: error: rank {rank}: {said}"
    journaled = events_by_rank(tmp_path / "j.db")
    assert sorted(journaled) == [0, 1]
    for events in journaled.values():
        (error,) = [e.event for e in events if isinstance(e.event, Error)]
        assert (error.error_kind, error.message, error.fatal) == ("rank-disagreement", said, True)
    verdict = run_cli("replay", ["diagnose", "latest", "j.db"], cwd=tmp_path).stdout
    assert verdict.splitlines()[0].endswith(": failed"), verdict


def _blocks_sigterm(pid: int) -> bool:
    """Whether process `pid` holds SIGTERM blocked (its entry did that before importing
    torch), from its SigBlk mask in /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.ranks
def test_a_sigterm_while_a_rank_imports_torch_is_journaled(tmp_path: Path) -> None:
    """SIGTERM to a rank whose run is named, as soon as its entry holds the signal and while
    it still imports torch: once its journal is open it journals its start and the stop by
    SIGTERM, and exits 143 (it left nothing behind before)."""
    port = free_port()
    env = rank_env(0, 2, port, TORCHELASTIC_RUN_ID="job-3")
    with rank_process(tmp_path, env) as rank:
        wait_until(lambda: _blocks_sigterm(rank.proc.pid), within=60, what="its entry")
        rank.proc.send_signal(signal.SIGTERM)
        status, err = rank.stopped_with(within=60)
    assert status == 143, err[-2000:]
    events = events_by_rank(tmp_path / "j.db")[0]
    assert isinstance(events[0].event, RunStarted)
    (stop,) = [e for e in events if isinstance(e.event, Shutdown)]
    assert (stop.state, stop.event.signal) == ("created", "SIGTERM")
