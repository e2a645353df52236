"""Kill a rank of a real `lifecycle boot` with SIGKILL at a random moment, then check what its
journal still says. Shared by the test suite (a few dozen kills) and `python -m bench.soak`."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.zygote import Zygote
from lifecycle.store.journal import Journal

BOOT_TIMEOUT_S = 120.0
# Each kill first waits for its victim to journal a state drawn at random (so that kills land
# in every state however slow the machine is), then this long at most, drawn at random too.
KILL_STATES = ("gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers")
KILL_WINDOW_S = 0.5
HEARTBEAT_S = 0.05


@dataclass(frozen=True)
class KillResult:
    index: int
    ranks: int
    db: Path
    victim: int  # the rank that was killed (or was to be)
    killed: bool  # False when the startup finished before the kill landed
    delay_s: float
    integrity: str
    gapless: bool
    events: int
    last_state: str | None
    diagnosed_state: str | None
    outcome: str | None
    culprits: tuple[int, ...]
    problem: str | None  # what did not hold, if anything

    @property
    def ok(self) -> bool:
        return self.problem is None


def _rank_pid(db: Path, rank: int) -> int | None:
    """The pid `rank` journaled in its run_started event."""
    from lifecycle.core.format.events import RunStarted

    journal = Journal.open_for_read(str(db))
    try:
        for stored in journal.read(rank=rank):
            if isinstance(stored.event, RunStarted):
                return stored.event.pid
    finally:
        journal.close()
    return None


def _state_seen(db: Path, rank: int, state: str, deadline: float) -> bool:
    """Whether `rank` journaled an event in `state` (or ended its startup) before `deadline`."""
    while time.monotonic() < deadline:
        if db.exists():
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM events WHERE rank = ?"
                        " AND state IN (?, 'ready', 'failed', 'stopped')",
                        (rank, state),
                    ).fetchone()
                if row and row[0] > 0:
                    return True
            except sqlite3.Error:
                pass  # tables not created yet
        time.sleep(0.02)
    return False


def kill_once(zygote: Zygote, root: Path, index: int, *, ranks: int, seed: int) -> KillResult:
    """One startup, one SIGKILL of its last rank, then the checks."""
    rng = random.Random(seed * 100_003 + index)
    where = root / f"kill-{ranks}r-{index}"
    where.mkdir(parents=True, exist_ok=True)
    db = where / "j.db"
    victim = ranks - 1
    argv = [
        "boot", "--model", "micro-video", "--calibrate", "--db", str(db),
        "--num-ranks", str(ranks), "--heartbeat-interval", str(HEARTBEAT_S),
        "--dist-timeout", "10", "--log-level", "error",
    ]  # fmt: skip
    proc = zygote.start(argv, cwd=where)
    target = rng.choice(KILL_STATES)
    delay = rng.uniform(0.0, KILL_WINDOW_S)
    killed = False
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        if _state_seen(db, victim, target, deadline):
            time.sleep(delay)  # the random moment is the point of the test
            pid = proc.pid if ranks == 1 else _rank_pid(db, victim)
            if pid is not None and proc.poll() is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    killed = False
        proc.wait(timeout=BOOT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return check(
        db,
        index=index,
        ranks=ranks,
        victim=victim,
        killed=killed,
        delay=delay,
        exit_code=proc.poll(),
    )


def _has_events(db: Path) -> bool:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return bool(conn.execute("SELECT count(*) FROM events").fetchone()[0])
    except sqlite3.Error:
        return False


def check(
    db: Path,
    *,
    index: int,
    ranks: int,
    victim: int,
    killed: bool,
    delay: float,
    exit_code: int | None = None,
) -> KillResult:
    if not _has_events(db):
        # The startup ended before its first event: nothing was killed and nothing is left to
        # check, which is itself a finding (its exit status says why).
        return KillResult(
            index=index, ranks=ranks, db=db, victim=victim, killed=False, delay_s=delay,
            integrity="-", gapless=True, events=0, last_state=None, diagnosed_state=None,
            outcome=None, culprits=(), problem=f"the startup wrote no event (exit {exit_code})",
        )  # fmt: skip
    problems = []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        integrity = str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    if integrity != "ok":
        problems.append(f"integrity_check: {integrity}")
    journal = Journal.open_for_read(str(db))
    (run,) = journal.runs()
    events = list(journal.read(run_id=run.run_id))
    journal.close()
    by_rank: dict[int, list[int]] = {}
    for stored in events:
        by_rank.setdefault(stored.rank, []).append(stored.seq)
    gapless = all(seqs == list(range(len(seqs))) for seqs in by_rank.values())
    if not gapless:
        problems.append("sequence gap")
    mine = [e for e in events if e.rank == victim]
    last_state = mine[-1].state if mine else None
    finished = bool(mine) and mine[-1].state == "stopped"
    if finished:
        killed = False
    outcome = diagnosed = None
    culprits: tuple[int, ...] = ()
    if killed:
        # A crash is told from a live rank by silence: let the heartbeat interval pass.
        quiet_until = (mine[-1].wall_time if mine else 0.0) + 0.6
        while time.time() < quiet_until:
            time.sleep(0.05)
        doc = diagnose_json(db, run.run_id)
        outcome = doc["outcome"]
        culprits = tuple(doc["culprit_ranks"])
        verdict = next((r for r in doc["ranks"] if r["rank"] == victim), None)
        diagnosed = verdict["last_state"] if verdict else None
        if outcome != "crashed" or culprits[:1] != (victim,):
            problems.append(f"diagnosed {outcome} {list(culprits)}: {doc['summary'][:300]}")
        if diagnosed != last_state:
            problems.append(f"diagnosed state {diagnosed}, journal says {last_state}")
    return KillResult(
        index=index, ranks=ranks, db=db, victim=victim, killed=killed, delay_s=delay,
        integrity=integrity,
        gapless=gapless, events=len(events), last_state=last_state, diagnosed_state=diagnosed,
        outcome=outcome, culprits=culprits, problem="; ".join(problems) or None,
    )  # fmt: skip


def diagnose_json(db: Path, run_id: str) -> dict[str, Any]:
    """`replay diagnose --json`, called in process (what the command prints, as a dict)."""
    from replay.load import Journals
    from replay.verdict.analysis import analyze
    from replay.verdict.diagnose import diagnose
    from replay.views.diagnosis import diagnosis_json

    with Journals.open([str(db)]) as journals:
        run = journals.resolve(run_id)
        return diagnosis_json(diagnose(analyze(run, journals.events(run)), now=time.time()))


def kill_loop(
    root: Path, *, kills: int, seed: int, two_rank_share: float = 0.1, parallel: int = 4
) -> Iterator[KillResult]:
    """Kill until `kills` kills landed (a startup that finished first does not count)."""
    landed = 0
    index = 0
    # Startups are forked from one process that imported lifecycle and torch already: the
    # same `lifecycle boot` entry, without an import per kill.
    zygote = Zygote()
    try:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            running: set[Future[KillResult]] = set()
            while landed < kills or running:
                while landed + len(running) < kills and len(running) < parallel:
                    ranks = 2 if random.Random(seed + index).random() < two_rank_share else 1
                    running.add(pool.submit(kill_once, zygote, root, index, ranks=ranks, seed=seed))
                    index += 1
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    result = future.result()
                    landed += result.killed
                    yield result
    finally:
        zygote.close()
