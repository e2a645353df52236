"""The agreed abort: a rank that fails for good announces its failure in the rendezvous store,
and every other rank's watcher learns it within a poll interval, journals why it stops, and
leaves, instead of waiting in its next collective until the process-group timeout.

The rendezvous store (a TCPStore) is what every rank already reaches: rank 0's under the
launcher, torchrun's agent's under torchrun, on whatever host it runs. The first failure
announced wins (compare-and-set), so every rank names the same culprit. A store that stops
answering is itself news: its host (rank 0's process, or node 0) is gone.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

ABORT_POLL_S = 0.2
# A store that does not answer for this long is gone (a round trip on a loaded host takes
# milliseconds; the rank writing the store's server may be busy for a moment, not for seconds).
STORE_GONE_S = 3.0
# How long stopping the watcher waits for a store request in flight (each is bounded by the
# store's own timeout; a store gone answers with an error at once).
STOP_WITHIN_S = 5.0
STORE_CONNECT_S = 10.0
MAX_MESSAGE_CHARS = 2000


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


def host_store(port: int, *, world_size: int) -> Any:
    """The rendezvous store, served from the launcher's process on 127.0.0.1:`port`."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=STORE_CONNECT_S),
        wait_for_workers=False,
        multi_tenant=True,
    )


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


def announce(store: Any, run_id: str, failure: Failure) -> Failure:
    """Announce `failure` unless a failure was announced first; the one that stands."""
    key = abort_key(run_id)
    standing = store.compare_set(key, "", failure.to_json())
    return Failure.from_json(standing) or failure


class AbortWatcher:
    """A thread that calls `on_abort` once, with the first failure of another rank, or with
    the store's own going away; stopped by `stop`."""

    def __init__(
        self,
        store: Any,
        *,
        run_id: str,
        rank: int,
        on_abort: Callable[[Failure], None],
        poll_s: float = ABORT_POLL_S,
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._key = abort_key(run_id)
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
                return Failure.from_json(self._store.get(self._key))
            except RuntimeError as exc:
                return store_gone(exc)

    def announce(self, failure: Failure) -> Failure | None:
        """Announce this rank's failure; None when the store no longer answers (its peers'
        watchers see that themselves)."""
        with self._lock:
            try:
                return announce(self._store, self._run_id, failure)
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
            failure = None if raw is None else Failure.from_json(raw)
            if failure is not None and failure.rank != self._rank:
                self._on_abort(failure)
                return


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
    run_id: str,
    rank: int,
    world_size: int,
    on_abort: Callable[[Failure], None],
) -> AbortWatcher:
    """Start watching the rendezvous store for a peer's failure."""
    watcher = AbortWatcher(
        store_client(env, world_size=world_size), run_id=run_id, rank=rank, on_abort=on_abort
    )
    watcher.start()
    return watcher
