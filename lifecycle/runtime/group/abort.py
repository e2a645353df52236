"""The agreed abort: a rank that fails for good announces its failure in the rendezvous store,
and every other rank's watcher learns it within a poll interval, journals why it stops, and
leaves, instead of waiting in its next collective until the process-group timeout.

The rendezvous store (a TCPStore) is what every rank already reaches: the launcher's (on
127.0.0.1 only) or torchrun's agent's, on whatever host it runs. The first failure announced
wins (compare-and-set), so every rank names the same culprit. Each announcement is sealed with
the run's store key (lifecycle.runtime.group.storetrust): one that is not, whoever wrote it, is
dropped, and a real announcement takes its place. A store that stops answering is itself
news: its host (the launcher, or node 0) is gone. A rank that finds itself announced lost by
rank 0's server (its beats stopped while it was stopped or starved) fails: the group went on
without it.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lifecycle.runtime.group.storetrust import NOT_A_MESSAGE, StoreTrust

ABORT_POLL_S = 0.2
# A store that does not answer for this long is gone (a round trip on a loaded host takes
# milliseconds; the rank writing the store's server may be busy for a moment, not for seconds).
STORE_GONE_S = 3.0
# How long stopping the watcher waits for a store request in flight (each is bounded by the
# store's own timeout; a store gone answers with an error at once).
STOP_WITHIN_S = 5.0
STORE_CONNECT_S = 10.0
MAX_MESSAGE_CHARS = 2000
# How many times an announcement takes the place of a value that is not one (a forgery) before
# it gives up: each try is one compare-and-set, and only a writer racing it can use them up.
ANNOUNCE_TRIES = 8
ABORT_CHANNEL = "abort"


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A rank's failure as announced to its peers."""

    rank: int | None  # None: the store went away, and with it whoever hosted it
    error_type: str
    error_kind: str
    message: str
    state: str | None
    wall: float  # when it was announced, on the announcer's clock
    announced_by: str  # "rank", "launcher" or "store"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "message": self.message[:MAX_MESSAGE_CHARS]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Failure | None:
        """The failure a store holds; None for a value that is not one (never trusted blindly:
        any process that reaches the store could have written it)."""
        try:
            doc = json.loads(text)
            return cls(
                rank=None if doc["rank"] is None else int(doc["rank"]),
                error_type=str(doc["error_type"])[:200],
                error_kind=str(doc["error_kind"])[:64],
                message=str(doc["message"])[:MAX_MESSAGE_CHARS],
                state=None if doc["state"] is None else str(doc["state"])[:64],
                wall=float(doc["wall"]),
                announced_by=str(doc["announced_by"])[:16],
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            return None


def abort_key(run_id: str) -> str:
    return f"lifecycle/{run_id}/abort"


def store_client(
    env: Mapping[str, str], *, world_size: int, connect_s: float = STORE_CONNECT_S
) -> Any:
    """A client of the rendezvous store at MASTER_ADDR:MASTER_PORT, of its own connection."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=connect_s),
        wait_for_workers=False,
    )


# Set for rank processes whose launcher hosts the rendezvous store, as torchrun's agent does:
# every rank (rank 0 too) is then a client, and the store outlives any rank.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def host_store(*, world_size: int, port: int = 0) -> Any:
    """A rendezvous store served from this process on 127.0.0.1 only (its `port`; 0 for a free
    one): torch's own binds every interface, whatever host it is given, and anything that
    reached it could end the run or steer it."""
    return serve_store(store_socket(port), world_size=world_size)


def store_socket(port: int = 0) -> socket.socket:
    """The rendezvous store's listening socket on 127.0.0.1 (`port`; 0 for a free one), ready
    before the store is: its port can be handed to ranks that start while torch imports
    here, and their connections wait in its backlog until `serve_store` answers them."""
    return socket.create_server(("127.0.0.1", port), backlog=128)


def serve_store(listening: socket.socket, *, world_size: int) -> Any:
    """The rendezvous store, served on `listening` (which it owns from then on, and closes
    when it ends; closed here when the store cannot start)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        store = TCPStore(
            "127.0.0.1",
            listening.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=STORE_CONNECT_S),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=listening.fileno(),
            use_libuv=True,
        )
    except BaseException:
        listening.close()
        raise
    listening.detach()
    return store


def store_gone(exc: BaseException) -> Failure:
    return Failure(
        rank=None,
        error_type=type(exc).__name__,
        error_kind="peer-gone",
        message="the rendezvous store stopped answering: its host (the launcher, rank 0's"
        " process, or torchrun's agent) is gone",
        state=None,
        wall=time.time(),
        announced_by="store",
    )


def standing_failure(raw: bytes, trust: StoreTrust, *, slot: str) -> Failure | None:
    """The failure the abort slot holds, sealed with the run's key; None (dropped, counted)
    for anything else."""
    body = trust.open(raw, channel=ABORT_CHANNEL, slot=slot)
    if body is None:
        return None
    failure = Failure.from_json(body)
    if failure is None:
        trust.reject(ABORT_CHANNEL, slot=slot, data=raw, reason=NOT_A_MESSAGE)
    return failure


def announce(store: Any, trust: StoreTrust, failure: Failure) -> Failure:
    """Announce `failure` unless a failure was announced first; the one that stands. A value
    in the slot that is not a sealed failure holds it for nobody: this one takes its place."""
    key = abort_key(trust.key.run_id)
    mine = trust.key.seal(failure.to_json().encode(), channel=ABORT_CHANNEL)
    expected = b""
    for _ in range(ANNOUNCE_TRIES):
        standing = store.compare_set(key, expected, mine)
        if standing == mine:
            return failure
        found = standing_failure(standing, trust, slot=key)
        if found is not None:
            return found
        expected = standing
    return failure


class AbortWatcher:
    """A thread that calls `on_abort` once: with the first failure of another rank, with the
    server's taking this rank for lost, or with the store's own going away; stopped by
    `stop`."""

    def __init__(
        self,
        store: Any,
        *,
        trust: StoreTrust,
        rank: int,
        on_abort: Callable[[Failure], None],
        poll_s: float = ABORT_POLL_S,
    ) -> None:
        self._store = store
        self._trust = trust
        self._key = abort_key(trust.key.run_id)
        self._rank = rank
        self._on_abort = on_abort
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one request on the store's connection at a time
        self._thread = threading.Thread(target=self._run, name="lifecycle-abort", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, within_s: float = STOP_WITHIN_S) -> None:
        """Stop watching, and wait (bounded) for a store request in flight to end: a thread
        left inside one when the interpreter exits ends the process in std::terminate."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(within_s)

    def first_failure(self) -> Failure | None:
        """The failure announced first, if any (a read of the store now); a store that does
        not answer is itself the failure of its host."""
        with self._lock:
            try:
                if not self._store.check([self._key]):
                    return None
                raw = self._store.get(self._key)
            except RuntimeError as exc:
                return store_gone(exc)
        return standing_failure(raw, self._trust, slot=self._key)

    def announce(self, failure: Failure) -> Failure | None:
        """Announce this rank's failure; None when the store no longer answers (its peers'
        watchers see that themselves)."""
        with self._lock:
            try:
                return announce(self._store, self._trust, failure)
            except RuntimeError:
                return None

    def _run(self) -> None:
        unanswered_since: float | None = None
        while not self._stop.wait(self._poll_s):
            try:
                with self._lock:
                    present = self._store.check([self._key])
                    raw = self._store.get(self._key) if present else None
                unanswered_since = None
            except RuntimeError as exc:
                now = time.monotonic()
                unanswered_since = unanswered_since or now
                if now - unanswered_since < STORE_GONE_S:
                    continue
                self._on_abort(store_gone(exc))
                return
            failure = None if raw is None else standing_failure(raw, self._trust, slot=self._key)
            if failure is not None and (failure.rank != self._rank or taken_for_lost(failure)):
                self._on_abort(failure)
                return


def taken_for_lost(failure: Failure) -> bool:
    """Whether `failure` is rank 0's server taking its rank for lost (its beats stopped): a
    rank that reads it of itself was stopped or cut off, and the group went on without it. (A
    peer's announcement of rank 0, whose broadcasts failed, may follow another rank's death.)"""
    return failure.announced_by == "server"


def rank_lost(rank: int, message: str, *, state: str | None, announced_by: str) -> Failure:
    """How a rank lost without a word (its process or host gone) is announced for it: by
    rank 0's server under torchrun, or by a peer when rank 0 is the one lost."""
    return Failure(
        rank=rank,
        error_type="RankLost",
        error_kind="peer-gone",
        message=message[:MAX_MESSAGE_CHARS],
        state=state,
        wall=time.time(),
        announced_by=announced_by,
    )


def failure_of(exc: BaseException, *, rank: int, state: str, kind: str) -> Failure:
    """How a rank announces its own fatal error."""
    text = str(exc).strip()
    return Failure(
        rank=rank,
        error_type=type(exc).__name__,
        error_kind=kind,
        message=(text.splitlines()[0] if text else type(exc).__name__)[:MAX_MESSAGE_CHARS],
        state=state,
        wall=time.time(),
        announced_by="rank",
    )


def watch_peers(
    env: Mapping[str, str],
    *,
    trust: StoreTrust,
    rank: int,
    world_size: int,
    on_abort: Callable[[Failure], None],
) -> AbortWatcher:
    """Start watching the rendezvous store for a peer's failure."""
    watcher = AbortWatcher(
        store_client(env, world_size=world_size), trust=trust, rank=rank, on_abort=on_abort
    )
    watcher.start()
    return watcher
