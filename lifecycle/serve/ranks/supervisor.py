"""The launcher's side of several ranks: spawn them, follow their journal, end what is left."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import PeerFailure, ServerArgs, args_to_json
from lifecycle.runtime.artifacts.signing import (
    ARTIFACT_KEY_ENV,
    ARTIFACT_KEY_FILE_ENV,
    artifact_key,
)
from lifecycle.runtime.group.storetrust import (
    STORE_KEY_ENV,
    STORE_KEY_FILE_ENV,
    RunKey,
    StoreTrust,
    new_store_secret,
)
from lifecycle.serve.console.steps import StepMark, StepPipes
from lifecycle.serve.ranks.launchtime import LAUNCHED_AT_ENV
from lifecycle.serve.ranks.rankenv import RUN_ID_ENV, WORKER_ENV, WorkerSpec
from lifecycle.store import Journal
from lifecycle.store.runs import new_run_id, open_run
from lifecycle.store.summaries import with_latest_heartbeat
from lifecycle.verdict.launched import (
    exit_text,
)

WORKER_MODULE = "lifecycle.serve.ranks.worker"  # the entry of a spawned rank process
POLL_S = 0.2
# After the first rank settles (fails, exits, stops), the others get the process-group timeout
# plus this margin to settle too before the launcher ends them.
SETTLE_MARGIN_S = 5.0
TERM_GRACE_S = 10.0
# With the agreed abort, the others learn a rank's failure within a fraction of a second and
# leave; this is how long they get before the launcher ends them.
ABORT_GRACE_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchOptions:
    """How the launcher was asked to run, handed down to every rank process."""

    pipeline: str | None = None
    json_logs: bool = False
    log_level: str = "info"
    command: str | None = None  # the launch command line, recorded with the run

    def worker_spec(self, args: ServerArgs, *, mode: str, **control: Any) -> WorkerSpec:
        return WorkerSpec(
            config=args_to_json(args),
            mode=mode,
            pipeline=self.pipeline,
            json_logs=self.json_logs,
            log_level=self.log_level,
            command=self.command,
            **control,
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankGroup:
    """N rank processes of one run, and what their journal says of them."""

    def __init__(
        self,
        args: ServerArgs,
        *,
        created_at: float,
        spec: WorkerSpec,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = args
        self.env = dict(env or {})  # added to every rank process's environment
        self.created_at = created_at
        self.run_id = run_id or new_run_id(created_at)
        self.spec = spec
        self.procs: list[subprocess.Popen[bytes]] = []
        self._folds: dict[int, RankFold] = {
            r: RankFold(run_id=self.run_id, rank=r) for r in range(args.num_ranks)
        }
        self.first_settled_at: float | None = None
        self.port: int | None = None  # the rendezvous store's
        self._store: Any = None  # the rendezvous store, hosted here while several ranks run
        self._trust: StoreTrust | None = None  # its run key, handed to the ranks
        self.store_authenticated = True  # every message through the store is sealed
        self._announced: set[int] = set()
        self.last_progress: dict[int, float] = {}  # monotonic time of each rank's last event
        self._steps: StepPipes | None = None  # each rank's denoising steps, beside the journal
        open_run(args, run_id=self.run_id, created_at=created_at, command=spec.command).close()
        self._reader = Journal.open_for_read(args.db)

    def start(self, *, stderr_of: Callable[[int], int | None] | None = None) -> None:
        """Spawn the ranks; `stderr_of(rank)` may give a rank's stderr (a descriptor this
        group closes once the rank holds it), else it shares the launcher's. Several ranks meet
        at a rendezvous store hosted here on 127.0.0.1 only, whose messages are sealed with a
        key made for this run and handed to the ranks alone (their environment)."""
        secret = new_store_secret()
        self._trust = StoreTrust(RunKey(secret.encode(), run_id=self.run_id))
        listening = None
        if self.args.num_ranks > 1:
            # Hosted here, as torchrun's agent hosts its store: it outlives any rank, so a
            # rank's failure still reaches its peers after rank 0 is gone (the agreed abort).
            # Its socket first: torch's import for the store itself runs while the ranks
            # start, not before them.
            from lifecycle.runtime.group.abort import store_socket

            listening = store_socket()
            port = self.port = int(listening.getsockname()[1])
        else:
            port = self.port = free_port()  # named for the rank, which joins no group
        steps = self._steps = StepPipes(self.args.num_ranks)
        base = self._rank_env(secret, port, hosted=listening is not None)
        for rank in range(self.args.num_ranks):
            env = {**base, **steps.env_for(rank), "RANK": str(rank), "LOCAL_RANK": str(rank)}
            stderr = stderr_of(rank) if stderr_of is not None else None
            self.procs.append(
                subprocess.Popen(
                    # -P: the working directory is not on the rank's path, so that a folder
                    # holding a `lifecycle/` (a checkout) never replaces the launcher's own.
                    [sys.executable, "-P", "-m", "lifecycle.serve.ranks.worker"],
                    env=env,
                    pass_fds=steps.pass_fds(rank),
                    stderr=stderr,
                )
            )
            steps.spawned(rank)
            if stderr is not None:
                os.close(stderr)
        if listening is not None:
            self._serve_store(listening)

    def _rank_env(self, secret: str, port: int, *, hosted: bool) -> dict[str, str]:
        """What every rank process's environment holds: this one's, the group's additions,
        the run's store key, settings and id, and where the rendezvous is."""
        inherited = {**os.environ, **self.env}
        inherited.pop(STORE_KEY_FILE_ENV, None)  # this run's own key replaces an operator's
        if self.args.enable_torch_compile:
            # The ranks sign and check artifacts with the key this process resolves, never
            # with one derived from the run's own store key.
            signer = artifact_key(inherited, journal=self.args.db)
            inherited.pop(ARTIFACT_KEY_FILE_ENV, None)
            inherited[ARTIFACT_KEY_ENV] = signer.text
        base = {
            **inherited,
            STORE_KEY_ENV: secret,
            WORKER_ENV: self.spec.to_env(),
            RUN_ID_ENV: self.run_id,
            # The launch the ranks count from: this process's start, as the run's.
            LAUNCHED_AT_ENV: repr(self.created_at),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(self.args.num_ranks),
            "LOCAL_WORLD_SIZE": str(self.args.num_ranks),
        }
        if hosted:
            from lifecycle.runtime.group.abort import AGENT_STORE_ENV

            base[AGENT_STORE_ENV] = "True"
        return base

    def _serve_store(self, listening: socket.socket) -> None:
        """The rendezvous store on its socket, once the ranks are spawned (they connect only
        after their own imports); no rank outlives a launch whose store cannot start."""
        from lifecycle.runtime.group.abort import serve_store

        try:
            self._store = serve_store(listening, world_size=self.args.num_ranks)
        except BaseException:
            for proc in self.procs:
                proc.kill()
                proc.wait(timeout=30)
            raise

    def steps(self) -> dict[int, StepMark]:
        """Each rank's latest denoising step mark (not journaled: see
        lifecycle.serve.console.steps)."""
        return {} if self._steps is None else self._steps.read()

    # -- following the journal -----------------------------------------------------------------

    def poll(self) -> list[StoredEvent]:
        """Fold in what each rank journaled since the last poll, and its latest heartbeat;
        return the new events."""
        new: list[StoredEvent] = []
        for rank, fold in self._folds.items():
            for stored in self._reader.read(
                run_id=self.run_id, rank=rank, from_seq=fold.last_seq + 1
            ):
                fold.apply(stored)
                new.append(stored)
                if stored.kind != "heartbeat":
                    self.last_progress[rank] = time.monotonic()
        # Once a rank serves, its heartbeats live in its summary row rather than as events:
        # its latest is read from there, so that an idle rank is seen beating.
        for summary in self._reader.summaries([self.run_id], checkpoints=False):
            beating = self._folds.get(summary.rank)
            if beating is not None:
                with_latest_heartbeat(beating, summary.last_heartbeat_wall)
        new.sort(key=lambda s: s.wall_time)
        return new

    def views(self) -> dict[int, RankView]:
        return {rank: fold.view() for rank, fold in self._folds.items()}

    def lost(self) -> dict[int, str]:
        """Ranks lost without a word: none here, where each is a process of this one's."""
        return {}

    def hosts(self) -> dict[int, str]:
        return dict.fromkeys(self._folds, socket.gethostname())

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def settled(self) -> list[bool]:
        """A rank is settled once its journal says failed or stopped, or its process ended."""
        codes = self.exit_codes()
        return [
            self._folds[r].state in (State.FAILED, State.STOPPED) or codes[r] is not None
            for r in range(len(self.procs))
        ]

    def any_failed(self) -> bool:
        codes = self.exit_codes()
        return any(
            self._folds[r].state == State.FAILED or codes[r] not in (None, 0)
            for r in range(len(self.procs))
        )

    def announce_ended(self) -> None:
        """For the agreed abort: announce each rank whose process ended without journaling its
        failure (killed, out of memory, its journal lost), so that its peers learn it from the
        rendezvous store as from a rank's own announcement. When the store went with the rank
        (rank 0 hosts it), the peers' watchers see the store gone themselves."""
        if self.args.on_peer_failure is not PeerFailure.ABORT or self._store is None:
            return
        assert self._trust is not None
        for rank, code in enumerate(self.exit_codes()):
            if code in (None, 0) or rank in self._announced:
                continue
            self._announced.add(rank)
            if self._folds[rank].state == State.FAILED:
                continue  # it journaled its failure, and announced it itself
            from lifecycle.runtime.group.abort import Failure, announce

            failure = Failure(
                rank=rank,
                error_type="ProcessEnded",
                error_kind="peer-gone",
                message=f"rank {rank}'s process ended: {exit_text(code)}",
                state=self._folds[rank].state,
                wall=time.time(),
                announced_by="launcher",
            )
            with contextlib.suppress(RuntimeError):
                announce(self._store, self._trust, failure)

    # -- ending --------------------------------------------------------------------------------

    def signal_all(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def end(self) -> None:
        """Let ranks that journaled `stopped` finish their teardown, SIGTERM what is still
        running (each rank journals its shutdown), then SIGKILL."""
        deadline = time.monotonic() + TERM_GRACE_S
        for rank, proc in enumerate(self.procs):
            if self._folds[rank].state == State.STOPPED:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=TERM_GRACE_S)

    def close(self) -> None:
        self._reader.close()
        self._store = None
        if self._steps is not None:
            self._steps.close()


def supervise(
    group: RankGroup,
    *,
    on_events: Callable[[list[StoredEvent]], None],
    keep_going: Callable[[], bool],
) -> None:
    """Follow the ranks until every one settles; once one has, give the others time to
    settle too (with the agreed abort, ABORT_GRACE_S to journal why they stop and leave; with
    --on-peer-failure wait, the process-group timeout plus a margin), and stop waiting early
    for a rank that has journaled nothing but heartbeats for that long (hung: any collective
    it waited in would have timed out). Then end what is left."""
    if group.args.on_peer_failure is PeerFailure.ABORT:
        margin = ABORT_GRACE_S
    else:
        margin = group.args.dist_timeout_s + SETTLE_MARGIN_S
    try:
        while keep_going():
            on_events(group.poll())
            group.announce_ended()
            settled = group.settled()
            if all(settled):
                break
            now = time.monotonic()
            if any(settled) and group.first_settled_at is None:
                group.first_settled_at = now
            if group.first_settled_at is not None:
                waiting = [r for r, done in enumerate(settled) if not done]
                stuck = all(now - group.last_progress.get(r, 0.0) > margin for r in waiting)
                if now - group.first_settled_at > margin or stuck:
                    break
            time.sleep(POLL_S)
    except BaseException:
        # The journal could not be read (its server gone), or the launcher was stopped: the
        # ranks are ended before it leaves, so that none outlives it and none loses the
        # rendezvous store it hosts while still reading from it.
        group.end()
        raise
    group.end()
    on_events(group.poll())
