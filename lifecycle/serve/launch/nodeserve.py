"""`lifecycle serve` under torchrun, on one host or several: every process is a rank of the
group, and global rank 0 also answers HTTP, as the single-host server does, with the same
Service behind the same endpoints. Its ranks are reached through lifecycle.serve.ranks.crossnode
(torchrun's store and a gloo group) instead of spawned processes' connections, and their
views are folded from the events each rank sends there, whatever journal each node writes.

A rank lost without a word (its process killed, its host gone) is found by its beat stopping
or by rank 0's next broadcast failing; rank 0 then fails the server (/liveness 503), announces
the loss in the rendezvous store as the launcher announces a rank process that ended (every
rank aborts at once), and exits 1 after --linger, so that torchrun's agents restart the group.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lifecycle.core.command import Exit
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import PeerFailure, ServerArgs
from lifecycle.runtime.group.signals import leave_process
from lifecycle.serve.console.steps import StepMark
from lifecycle.serve.http.front import FrontOptions
from lifecycle.serve.logs import say
from lifecycle.serve.ranks.control import ControlChannel
from lifecycle.serve.ranks.crossnode import BEAT_S, SUSPECT_S, Broadcaster, RankBridge, RankLine
from lifecycle.serve.ranks.messages import FromRank, Hello, Lost, Stop
from lifecycle.serve.ranks.rankenv import RankEnv
from lifecycle.serve.ranks.upreader import StoreReader
from lifecycle.serve.ranks.wire import Up
from lifecycle.store.summaries import with_latest_heartbeat

if TYPE_CHECKING:
    from lifecycle.runtime.group.storetrust import StoreTrust
    from lifecycle.runtime.session import RankSession

STOP_SERVER_S = 10.0  # how long the HTTP server gets to answer what it is answering
STOP_OTHERS_S = 2.0  # how long a signalled rank 0 waits for its stop to reach the others


class NodeRanks:
    """Every rank of a torchrun serve as rank 0's server knows them: each rank's events as
    they arrive, folded; its host; and whether it was lost."""

    def __init__(
        self, args: ServerArgs, *, created_at: float, store: Any, trust: StoreTrust
    ) -> None:
        self.args = args
        self.run_id = run_id = trust.key.run_id
        self.created_at = created_at
        self._store = store  # for announcing a lost rank to the others
        self._trust = trust
        self.store_authenticated = trust.key.authenticated
        self._folds = {r: RankFold(run_id=run_id, rank=r) for r in range(args.num_ranks)}
        self._lock = threading.Lock()
        self._arrived: list[StoredEvent] = []
        self._beats: dict[int, float] = {}
        self._hosts: dict[int, str] = {}
        self._lost: dict[int, str] = {}
        self._announced: set[int] = set()

    # -- fed by the readers ---------------------------------------------------------------------

    def arrive(self, stored: StoredEvent) -> None:
        with self._lock:
            self._arrived.append(stored)

    def beat(self, rank: int) -> None:
        with self._lock:
            self._beats[rank] = time.time()

    def hello(self, hello: Hello) -> None:
        with self._lock:
            self._hosts[hello.rank] = hello.host

    def lose(self, rank: int, why: str) -> None:
        with self._lock:
            host = self._hosts.get(rank)
            self._lost.setdefault(rank, f"{why} (host {host})" if host else why)

    # -- what the Service reads ----------------------------------------------------------------

    def poll(self) -> list[StoredEvent]:
        with self._lock:
            arrived, self._arrived = self._arrived, []
            beats = dict(self._beats)
        new = []
        for stored in arrived:
            fold = self._folds.get(stored.rank)
            if fold is not None and stored.seq > fold.last_seq:
                fold.apply(stored)
                new.append(stored)
        for rank, wall in beats.items():
            with_latest_heartbeat(self._folds[rank], wall)
        new.sort(key=lambda s: s.wall_time)
        return new

    def views(self) -> dict[int, RankView]:
        return {rank: fold.view() for rank, fold in self._folds.items()}

    def steps(self) -> dict[int, StepMark]:
        return {}

    def exit_codes(self) -> list[int | None]:
        return [None] * self.args.num_ranks  # other hosts' processes: not ours to see

    def lost(self) -> dict[int, str]:
        with self._lock:
            return dict(self._lost)

    def hosts(self) -> dict[int, str]:
        with self._lock:
            return dict(self._hosts)

    def announce_ended(self) -> None:
        """Announce each lost rank in the rendezvous store, as the launcher announces a rank
        process that ended: its peers abort at once instead of waiting on it."""
        if self.args.on_peer_failure is not PeerFailure.ABORT:
            return
        from lifecycle.runtime.group.abort import announce, rank_lost

        for rank, why in self.lost().items():
            if rank in self._announced:
                continue
            self._announced.add(rank)
            failure = rank_lost(
                rank,
                f"rank {rank} lost: {why}",
                state=self._folds[rank].state,
                announced_by="server",
            )
            try:
                announce(self._store, self._trust, failure)
            except RuntimeError:
                return  # the store is gone: every rank's watcher sees that itself


class Front:
    """Rank 0's HTTP server and the lines to every rank, started once the run is named."""

    def __init__(
        self,
        args: ServerArgs,
        *,
        env: Mapping[str, str],
        sock: socket.socket,
        options: FrontOptions,
        created_at: float,
    ) -> None:
        self.args = args
        self.env = env
        self.created_at = created_at
        self.sock = sock
        self.options = options
        self.url = f"http://{options.host}:{sock.getsockname()[1]}"
        self.bridge = RankBridge(0, deliver=self._from_rank_0, on_group=self._control_group)
        self.broadcaster = Broadcaster(on_broken=self._broken)
        self.lines: dict[int, RankLine] = {}
        self.readers: list[StoreReader] = []
        self.ranks: NodeRanks | None = None
        self.trust: StoreTrust | None = None
        self.server: Any = None
        self.metrics: Any = None
        self.jobs: Any = None  # the OpenAI-compatible API's video jobs, once serving
        self._serving: threading.Thread | None = None
        self._leaving = threading.Lock()

    def start(self, run_id: str, recorder: Any, trust: StoreTrust) -> None:
        """Called once rank 0's journal is open: follow every rank and serve HTTP."""
        from lifecycle.runtime.group.abort import store_client
        from lifecycle.serve.http.app import is_loopback
        from lifecycle.serve.http.metrics import Metrics
        from lifecycle.serve.http.server import http_server
        from lifecycle.serve.http.service import Service

        world = self.args.num_ranks
        self.trust = trust
        ranks = self.ranks = NodeRanks(
            self.args,
            created_at=self.created_at,
            store=store_client(self.env, world_size=world),
            trust=trust,
        )
        control = ControlChannel(listen=False)
        for rank in range(world):
            line = self.lines[rank] = RankLine(rank, self._sender(rank))
            control.attach(rank, line)
        self._read_ranks(world, ranks, trust)
        recorder.subscribe(self.bridge.record)
        self.bridge.hello()
        # No restart here: rank 0 cannot start the other nodes' ranks again; serve fails and
        # torchrun's agent restarts the group (its own --max-restarts).
        service = self.service = Service(
            self.args, ranks, control, request_timeout_s=self.options.request_timeout_s
        )
        metrics = self.metrics = Metrics()
        metrics.add(service.metrics, queue_depth=service.queue_depth)
        threading.Thread(target=service.follow, name="journal-follower", daemon=True).start()
        from lifecycle.serve.openai.runner import start_jobs

        self.jobs = start_jobs(service, self.options)
        server = self.server = http_server(
            service, metrics, front=self.options, grace_s=STOP_SERVER_S, signals=False,
            jobs=self.jobs,
        )  # fmt: skip
        self._serving = threading.Thread(
            target=server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True
        )
        self._serving.start()
        threading.Thread(target=self._after_http, name="after-http", daemon=True).start()
        loopback = is_loopback(self.options.host)
        scope = "loopback only" if loopback else "REACHABLE FROM OTHER HOSTS"
        say(
            f"serving on {self.url} ({scope}; rank 0 of {world})",
            event="serving",
            url=self.url,
            loopback_only=loopback,
        )

    def _read_ranks(self, world: int, ranks: NodeRanks, trust: StoreTrust) -> None:
        """A reader of the store for each rank but rank 0: its messages, beats and loss."""
        from lifecycle.runtime.group.abort import store_client

        for rank in range(1, world):
            reader = StoreReader(
                store_client(self.env, world_size=world),
                trust=trust,
                rank=rank,
                on_message=self._arrival(rank),
                on_beat=ranks.beat,
                on_lost=self._lose,
            )
            self.readers.append(reader)
            reader.start()

    # -- the lines -----------------------------------------------------------------------------

    def _sender(self, rank: int) -> Any:
        if rank == 0:
            return self.bridge.put
        return lambda message: self.broadcaster.send((rank,), message)

    def _arrival(self, rank: int) -> Callable[[Up], None]:
        return lambda item: self._arrive(rank, item)

    def _from_rank_0(self, item: Up) -> None:
        self._arrive(0, item)

    def _arrive(self, rank: int, item: Up) -> None:
        ranks = self.ranks
        if ranks is None:
            return
        if isinstance(item, StoredEvent):
            ranks.arrive(item)
        elif isinstance(item, Hello):
            ranks.hello(item)
        else:
            reply: FromRank = item
            self.lines[rank].reply(reply)

    def _control_group(self, group: Any) -> None:
        assert self.trust is not None
        self.broadcaster.start(group, frozenset(range(1, self.args.num_ranks)), self.trust.key)

    def _lose(self, rank: int, why: str) -> None:
        if self.ranks is not None:
            self.ranks.lose(rank, why)
        self.lines[rank].close(why)

    def _broken(self, why: str) -> None:
        """A broadcast failed: some rank is gone, and nothing reaches the others any more. The
        beats say which within SUSPECT_S (it is then lost and announced); if none stopped,
        every other rank's line is closed with why."""
        say(f"serve: {why}", event="control-broken", why=why, out=sys.stderr)
        for reader in self.readers:
            reader.suspect()
        time.sleep(SUSPECT_S + 2 * BEAT_S)
        if self.ranks is None or not self.ranks.lost():
            for rank, line in self.lines.items():
                if rank != 0:
                    line.close(why)

    # -- ending --------------------------------------------------------------------------------

    def _after_http(self) -> None:
        """Once the HTTP server has stopped (after --linger, or told to), stop every rank that
        still serves, as the single-host server does: each journals why and leaves."""
        assert self._serving is not None
        self._serving.join()
        reason, signal_name = self.server.stop_reason()
        self.jobs.close(reason)
        stop = Stop(reason=reason, signal=signal_name)
        self.broadcaster.send(range(1, self.args.num_ranks), stop)
        self.bridge.put(stop)

    def stop_others(self, sig: signal.Signals) -> None:
        """Rank 0 was told to stop by a signal: tell every other rank to stop too, and give
        the broadcast a moment to go out, so that they journal a stop rather than rank 0's
        loss."""
        if not self.broadcaster.started:
            return  # not serving yet: they fail on rank 0's going, as at any startup
        reason = f"rank 0 received {sig.name}"
        self.broadcaster.send(range(1, self.args.num_ranks), Stop(reason=reason, signal=sig.name))
        self.broadcaster.ended.wait(STOP_OTHERS_S)

    def leave(self, status: int) -> None:
        """Rank 0's session ends the process from another thread (an agreed abort, a startup
        timeout): keep answering /liveness (503) for --linger first."""
        with self._leaving:
            self.finish(status)
            leave_process(status)

    def finish(self, status: int) -> int:
        """Rank 0's rank has ended with `status`: a failure is served for --linger, then the
        HTTP server stops."""
        server, serving = self.server, self._serving
        if server is None or serving is None:
            return status
        if status != Exit.OK:
            self.service.fail(f"rank 0 ended: exit status {status}")
            serving.join(self.options.linger_s + STOP_SERVER_S)
        server.should_exit = True
        serving.join(STOP_SERVER_S)
        self.broadcaster.close()
        for reader in self.readers:
            reader.close()
        if self.metrics is not None:
            self.metrics.close()
        return Exit.FAILED if self.service.failed else status


def serve_under_torchrun(
    args: ServerArgs,
    *,
    created_at: float,
    front: FrontOptions,
) -> int:
    """This process's rank of `serve` under torchrun; rank 0 also answers HTTP."""
    from lifecycle.runtime.group.abort import store_client
    from lifecycle.serve.http.server import listening
    from lifecycle.serve.ranks.rankserve import fail_on_lost
    from lifecycle.serve.ranks.worker import run_rank_process

    env = os.environ
    ranks = RankEnv.from_env(env)
    if ranks.world_size != args.num_ranks:
        raise ConfigError(
            f"torchrun started {ranks.world_size} ranks but --num-ranks is {args.num_ranks}",
            field="num_ranks",
        )
    if ranks.rank != 0:
        bridge = RankBridge(ranks.rank)

        def publish(run_id: str, recorder: Any, trust: StoreTrust) -> None:
            recorder.subscribe(bridge.record)
            bridge.publish(store_client(env, world_size=ranks.world_size), trust)

        def lost_before_signal(_sig: signal.Signals, session: RankSession) -> None:
            """A signal that reaches a rank the group has taken for lost (its node stopped,
            then resumed and ended by its agent) ends it as lost, as its inbox would have a
            moment later, not as stopped by the signal."""
            why = bridge.taken_for_lost()
            if why is not None:
                fail_on_lost(session, Lost(why=why, rank=ranks.rank))

        status = run_rank_process(
            args,
            mode="serve",
            env=env,
            created_at=created_at,
            control=bridge,
            on_journal=publish,
            before_signal_exit=lost_before_signal,
        )
        bridge.close()
        return status
    sock = listening(front.host, front.port)
    rank_0 = Front(args, env=env, sock=sock, options=front, created_at=created_at)
    status = run_rank_process(
        args,
        mode="serve",
        env=env,
        created_at=created_at,
        control=rank_0.bridge,
        on_journal=rank_0.start,
        leave=rank_0.leave,
        before_signal_exit=lambda sig, _session: rank_0.stop_others(sig),
    )
    return rank_0.finish(status)
