"""The keeper benchmark's processes: the keeper, serves, and what their journal and /proc tell."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.bootrun import run_ids
from bench.procs import stop_groups
from bench.serving import ServeProcess
from bench.suite import BenchError

if TYPE_CHECKING:
    from lifecycle.core.format.events import WeightsPath

KEY_VAR = "LIFECYCLE_ARTIFACT_KEY"
MAPPING_NAME = "lifecycle-weights"  # the keeper's memfd, as /proc/PID/smaps names its mappings
# The directory's options, boot and serve alike: float32 on CPU, and a small default request so
# that the fixed request (the bounded shape at min(2, steps) steps) stays cheap.
SHAPE, STEPS = "64x64x5", 1
DIRECTORY_OPTIONS = ("--dtype", "float32", "--device", "cpu", "--default-shape", SHAPE,
                     "--default-steps", str(STEPS), "--smoke-request", "off")  # fmt: skip
BOOT_OPTIONS = (*DIRECTORY_OPTIONS, "--warmup-mode", "none", "--log-level", "warning")
MICRO = ("--model", "micro-video", "--smoke-request", "off")
FOUR_RANKS = ("--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2")
BOOT_TIMEOUT_S = 900.0
SERVE_READY_S = 900.0
REST_TIMEOUT_S = 600.0  # a POST /sleep or /wake
KEEPER_READY_S = 60.0
GONE_TIMEOUT_S = 30.0
ATTACH, LOAD = "attach", "load"
OFF = "off"


# --- the keeper ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Keeper:
    proc: subprocess.Popen[bytes]
    socket: Path
    secret: str
    log: Path

    def status(self) -> dict[str, Any]:
        from lifecycle.runtime.keeping.keeperwire import KeeperKey, ask

        answer, fds = ask(self.socket, KeeperKey.derived(self.secret.encode()), {"op": "status"})
        for fd in fds:
            os.close(fd)
        return answer


@contextlib.contextmanager
def running_keeper(folder: Path, env: Mapping[str, str]) -> Iterator[Keeper]:
    """`lifecycle keeper` on a socket in `folder` (its default budget: half the host's memory),
    answering; stopped (SIGTERM, then SIGKILL of its group) on the way out."""
    from lifecycle.runtime.keeping.keeperwire import KeeperUnavailable

    folder.mkdir(parents=True, exist_ok=True)
    sock, log = folder / "socket" / "keeper.sock", folder / "keeper.log"
    command = [sys.executable, "-m", "lifecycle", "keeper", "--socket", str(sock),
               "--db", str(folder / "keeper.db")]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=dict(env),
            start_new_session=True,
        )  # fmt: skip
    keeper = Keeper(proc=proc, socket=sock, secret=env[KEY_VAR], log=log)
    try:
        deadline = time.monotonic() + KEEPER_READY_S
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the keeper exited {proc.returncode}: {_tail(log)}")
            try:
                keeper.status()
                break
            except KeeperUnavailable:
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"the keeper did not answer within {KEEPER_READY_S:.0f} s: {_tail(log)}"
                    ) from None
                time.sleep(0.1)
        yield keeper
    finally:
        stop_groups([proc], within_s=30.0)


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return text.splitlines()[-1][:300] if text else "(no output)"


# --- a startup as its journal tells it -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """One run's startup, and what followed it, from its journal."""

    run_id: str
    ready_s: float  # the run's creation (its launch) to the last rank's first ready
    weights: tuple[tuple[int, str, WeightsPath], ...]  # (rank, state, event), journal order
    kept: tuple[str, ...]  # each weights_kept outcome
    kept_s: tuple[float, ...]  # and its seconds (packing the copy, the keeper's answer)
    references: tuple[str, ...]  # each reference_output outcome
    rejected: int  # attach_rejected events
    actions: dict[tuple[str, str], tuple[float, ...]]  # (state, action): each rank's seconds
    requests: dict[tuple[str, str], float]  # (state, source): the slowest rank's total_s
    pids: tuple[int, ...]  # each rank's process, by rank

    def paths(self, state: str) -> list[WeightsPath]:
        return [event for _, at, event in self.weights if at == state]

    def expect(self, state: str, path: str, label: str) -> list[WeightsPath]:
        """The weights_path events of `state`, one per rank, each `path`; BenchError if not."""
        found = self.paths(state)
        if len(found) != len(self.pids) or any(e.path != path for e in found):
            said = "; ".join(f"{e.path} ({e.reason})" for e in found) or "none"
            raise BenchError(f"{label} (run {self.run_id}): expected {path} on every rank: {said}")
        if path == ATTACH and self.rejected:
            raise BenchError(f"{label} (run {self.run_id}): attached weights were rejected")
        return found

    def action(self, state: str, name: str, *, least: bool = False) -> float:
        """The slowest rank's seconds of action `name` in `state` (with `least`, the fastest
        rank's: where the ranks agree at its end, the others' include waiting for it)."""
        seconds = self.actions.get((state, name))
        if not seconds:
            raise BenchError(f"run {self.run_id} journaled no {name} action in {state}")
        return min(seconds) if least else max(seconds)


def new_run(db: Path, before: set[str]) -> str:
    new = run_ids(db) - before
    if len(new) != 1:
        raise BenchError(f"expected one new run in {db}, found {len(new)}")
    return new.pop()


def journaled(db: Path, run_id: str, *, ranks: int) -> Started:
    from lifecycle.core.format.events import (
        ActionFinished,
        AttachRejected,
        ReferenceOutput,
        RequestFinished,
        RequestStarted,
        RunStarted,
        WeightsKept,
        WeightsPath,
    )
    from lifecycle.core.format.fold import fold_run
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(str(db)) as journal:
        (run,) = [r for r in journal.runs() if r.run_id == run_id]
        stored = list(journal.read(run_id=run_id))
    views = fold_run(stored)
    ready_at = [view.entered_at("ready") for view in views.values()]
    if len(views) != ranks or any(at is None for at in ready_at):
        raise BenchError(f"run {run_id}: not all of its {ranks} ranks reached ready")
    weights, kept, kept_s, references, rejected = [], [], [], [], 0
    actions: dict[tuple[str, str], tuple[float, ...]] = {}
    requests: dict[tuple[str, str], float] = {}
    sources: dict[tuple[int, str], tuple[str, str]] = {}
    pids: dict[int, int] = {}
    for s in stored:
        event = s.event
        if isinstance(event, WeightsPath):
            weights.append((s.rank, s.state, event))
        elif isinstance(event, WeightsKept):
            kept.append(event.outcome)
            kept_s.append(event.seconds)
        elif isinstance(event, ReferenceOutput):
            references.append(event.outcome)
        elif isinstance(event, AttachRejected):
            rejected += 1
        elif isinstance(event, ActionFinished):
            key = (s.state, event.action)
            actions[key] = (*actions.get(key, ()), event.duration_s)
        elif isinstance(event, RequestStarted):
            sources[(s.rank, event.request_id)] = (s.state, event.source)
        elif isinstance(event, RequestFinished) and (s.rank, event.request_id) in sources:
            key = sources[(s.rank, event.request_id)]
            requests[key] = max(requests.get(key, 0.0), event.total_s)
        elif isinstance(event, RunStarted):
            pids[s.rank] = event.pid
    return Started(
        run_id=run_id,
        ready_s=max(at for at in ready_at if at is not None) - run.created_at,
        weights=tuple(weights), kept=tuple(kept), kept_s=tuple(kept_s),
        references=tuple(references), rejected=rejected, actions=actions, requests=requests,
        pids=tuple(pids[rank] for rank in sorted(pids)),
    )  # fmt: skip


# --- serving ---------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(
    label: str, options: Sequence[str], *, db: Path, env: Mapping[str, str], ranks: int
) -> Iterator[tuple[ServeProcess, Started]]:
    """`lifecycle serve OPTIONS` ready (/health 200), with its startup read from the journal;
    SIGTERMed on the way out if it still runs (its group SIGKILLed after a minute)."""
    before = run_ids(db)
    server = ServeProcess(
        label=label, options=options, db=db, cwd=db.parent, env=env,
        ready_within=SERVE_READY_S, request_timeout_s=REST_TIMEOUT_S,
    )  # fmt: skip
    with server:
        yield server, journaled(db, new_run(db, before), ranks=ranks)


def kill(server: ServeProcess, started: Started) -> None:
    """SIGKILL the server's process group (its ranks with it), then wait until every rank is
    gone, reaping the ranks that this run adopted (bench.reaper)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=GONE_TIMEOUT_S)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    for pid in started.pids:
        while _alive(pid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if time.monotonic() > deadline:
                raise BenchError(f"rank process {pid} still runs {GONE_TIMEOUT_S:.0f} s after kill")
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it holds no memory)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rpartition(")")[2].split()[0] != "Z"


def post(server: ServeProcess, path: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{server.url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=REST_TIMEOUT_S) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except OSError as exc:  # HTTPError included
        raise BenchError(f"POST {path} failed: {exc}: {server.tail()}") from None
    return answer


@dataclass(frozen=True, slots=True, kw_only=True)
class Mapped:
    """One process's mappings of the keeper's memfd, in bytes (/proc/PID/smaps)."""

    pss: int  # its share of their resident pages (a page N processes map counts 1/N)
    rss: int  # their resident pages, whoever else maps them
    anonymous: int  # pages of its own in them: copied on write


SMAPS_FIELDS = {"Pss:": "pss", "Rss:": "rss", "Anonymous:": "anonymous"}


def mapped_by(pid: int) -> Mapped:
    """What process `pid`'s mappings whose name holds MAPPING_NAME (the keeper's memfd)
    hold, summed over them."""
    found = dict.fromkeys(SMAPS_FIELDS.values(), 0)
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = MAPPING_NAME in line
        elif inside and (field := SMAPS_FIELDS.get(line.split(maxsplit=1)[0])):
            found[field] += int(line.split()[1]) * 1024
    return Mapped(**found)
