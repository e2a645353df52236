"""The control channel between `lifecycle serve` and its rank processes: typed messages and
both ends of the loopback connection that carries them."""

from __future__ import annotations

import os
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Protocol

from lifecycle.core.errors import LifecycleError
from lifecycle.runtime.group.storetrust import CHANNELS
from lifecycle.serve.ranks.messages import (
    Cancel,
    CancelAt,
    CancelPoint,
    Dump,
    FromRank,
    Generate,
    GivenUp,
    Hello,
    Lost,
    Progress,
    Ready,
    Rejected,
    Rest,
    Result,
    Stop,
    ToRank,
)


class InFlight(Protocol):
    """What the channel's readers tell the request in flight (serve.inflight's): each rank's
    progress, cancel point and result, or that its process went away."""

    request_id: str

    def progress(self, rank: int, step: int | None = None) -> None: ...

    def cancel_point(self, rank: int, step: int) -> None: ...

    def deliver(self, result: Result) -> None: ...

    def fail_rank(self, rank: int, error: str) -> None: ...


# -- the launcher's end ------------------------------------------------------------------------


class ServiceUnavailable(LifecycleError):
    """/generate cannot run now: the ranks are starting, failed, or the server is stopping."""

    def __init__(self, *, status: str, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s


class Line(Protocol):
    """What a rank's link reads and writes: a spawned rank's connection, or under torchrun
    the line rank 0's server keeps to each rank (lifecycle.serve.ranks.crossnode)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...


class LockedConnection:
    """A rank process's connection to the launcher, written from several threads (its replies,
    its counts of dropped messages), one message at a time."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._connection.send(obj)

    def recv(self) -> Any:
        return self._connection.recv()


@dataclass
class RankLink:
    """The control connection to one rank process."""

    connection: Connection | Line
    ready: threading.Event = field(default_factory=threading.Event)
    alive: bool = True
    gone: str = "closed its control connection"  # why it is not alive, after the rank

    def send(self, message: ToRank) -> bool:
        """Send `message`; False when the rank's end is gone."""
        try:
            self.connection.send(message)
        except OSError:
            return False
        return True


# A connection to the control port must complete the authkey handshake and say which rank it
# is within this long: a rank does so at once, and anything else (a port scanner, a client
# that connects and says nothing) is dropped without holding up the ranks.
HANDSHAKE_S = 10.0
ACCEPT_POLL_S = 0.2  # how often the accept loop looks whether the channel was closed


def _bound_io(sock: socket.socket, seconds: float) -> None:
    """Make a blocking read or write on `sock` fail after `seconds` (0: wait for ever), for
    every descriptor of the socket: multiprocessing's Connection reads the descriptor itself,
    past the Python socket's own timeout."""
    whole = int(seconds)
    value = struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class ControlChannel:
    """A loopback listener the rank processes connect to, authenticated by a random key; or,
    under torchrun, links attached to the ranks' lines (`attach`) and no listener."""

    def __init__(self, *, listen: bool = True) -> None:
        self.authkey = secrets.token_bytes(32)
        self.host, self.port = "", 0
        if listen:
            self._listening = socket.create_server(("127.0.0.1", 0))
            self._listening.settimeout(ACCEPT_POLL_S)
            host, port = self._listening.getsockname()[:2]
            self.host, self.port = str(host), int(port)
        self.links: dict[int, RankLink] = {}
        self._rejected: dict[tuple[int, str], int] = {}  # (rank, channel): messages it dropped
        self._lock = threading.Lock()
        self._request: InFlight | None = None
        self._closed = threading.Event()

    def accept(self, count: int) -> None:
        """Take connections until `count` ranks have said hello (each with its rank) or the
        channel closes; runs in its own thread. Each connection is vetted on a thread of its
        own, so that one that stalls or sends garbage holds up no other."""
        with self._listening:
            while not self._closed.is_set():
                with self._lock:
                    if len(self.links) >= count:
                        return
                try:
                    sock, _ = self._listening.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                threading.Thread(
                    target=self._admit, args=(sock,), name="control-handshake", daemon=True
                ).start()

    def _admit(self, sock: socket.socket) -> None:
        """Link the rank on `sock` once it proved it holds the key and said hello within
        HANDSHAKE_S; else drop it."""
        with sock:
            _bound_io(sock, HANDSHAKE_S)
            connection = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(connection, self.authkey)
                answer_challenge(connection, self.authkey)
                hello = connection.recv()
            except (OSError, EOFError, AuthenticationError):
                hello = None
            if not isinstance(hello, Hello) or self._closed.is_set():
                connection.close()
                return
            _bound_io(sock, 0)  # a rank's link is read for as long as the rank lives
        if not self.attach(hello.rank, connection):
            connection.close()

    def attach(self, rank: int, connection: Connection | Line) -> bool:
        """Link `rank` through `connection` and read it; False when the rank has a link."""
        link = RankLink(connection=connection)
        with self._lock:
            if rank in self.links:
                return False
            self.links[rank] = link
        threading.Thread(
            target=self._read, args=(rank, link), name=f"rank-{rank}-link", daemon=True
        ).start()
        return True

    def _read(self, rank: int, link: RankLink) -> None:
        while True:
            try:
                message = link.connection.recv()
            except (EOFError, OSError) as exc:
                if isinstance(exc, EOFError) and str(exc):
                    link.gone = str(exc)
                link.alive = False
                with self._lock:
                    request = self._request
                if request is not None:
                    request.fail_rank(rank, "rank process went away")
                return
            if isinstance(message, Ready):
                link.ready.set()
                continue
            if isinstance(message, Rejected):
                if message.channel in CHANNELS:
                    with self._lock:
                        slot = (rank, message.channel)
                        self._rejected[slot] = max(self._rejected.get(slot, 0), message.total)
                continue
            with self._lock:
                request = self._request
            # A result or progress for any other request is late: that request was already
            # answered (failed or abandoned), and its result must not answer the next one.
            if not isinstance(message, Progress | Result | CancelPoint) or request is None:
                continue
            if message.request_id != request.request_id:
                continue
            if isinstance(message, Progress):
                request.progress(rank, message.step)
            elif isinstance(message, CancelPoint):
                request.cancel_point(rank, message.step)
            else:
                request.deliver(message)

    def begin(self, request: InFlight) -> None:
        with self._lock:
            self._request = request

    def end(self, request: InFlight) -> None:
        with self._lock:
            if self._request is request:
                self._request = None

    def rejected(self) -> dict[tuple[int, str], int]:
        """Messages each rank dropped, by channel, as it last said."""
        with self._lock:
            return dict(self._rejected)

    def snapshot(self) -> dict[int, RankLink]:
        with self._lock:
            return dict(self.links)

    def dump(self, reason: str) -> list[int]:
        """Ask every rank to write its collective ring; the ranks that were asked."""
        return [
            rank for rank, link in sorted(self.snapshot().items()) if link.send(Dump(reason=reason))
        ]

    def close(self) -> None:
        self._closed.set()


# -- the rank's end ----------------------------------------------------------------------------


@dataclass(eq=False)
class ControlInbox:
    """The launcher's messages, read by a thread of their own (from `__post_init__` on), so
    that a stop reaches a rank that is busy in a request. A closed connection reads as a
    stop."""

    control: Connection | Line
    _: KW_ONLY
    on_dump: Callable[[str], object]
    on_given_up: Callable[[GivenUp], object]
    on_lost: Callable[[Lost], object] | None = None
    on_cancel: Callable[[Cancel | CancelAt], object] | None = None
    stop_message: Stop = field(default=Stop(reason="stop requested"), init=False)
    _messages: queue.Queue[Generate | Stop | Lost | Rest] = field(
        default_factory=queue.Queue, init=False
    )
    _stop_requested: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, name="lifecycle-control", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.control.recv()
            except (EOFError, OSError):
                message = Stop(reason="launcher went away")
            if isinstance(message, Stop):
                self.stop_message = message
                self._stop_requested.set()
                self._messages.put(message)
                return
            if isinstance(message, Lost):
                if self.on_lost is not None:
                    self.on_lost(message)
                self._messages.put(message)
                return
            if isinstance(message, Generate | Rest):
                self._messages.put(message)
            elif isinstance(message, Dump):
                self.on_dump(message.reason)
            elif isinstance(message, GivenUp):
                self.on_given_up(message)
            elif isinstance(message, Cancel | CancelAt) and self.on_cancel is not None:
                self.on_cancel(message)

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def wait_for_stop(self, timeout: float) -> bool:
        return self._stop_requested.wait(timeout)

    def next(self) -> Generate | Stop | Lost | Rest:
        return self._messages.get()

    def send(self, message: FromRank) -> None:
        """Send to the launcher; a launcher that went away is noticed by the reader, as a
        stop."""
        try:
            self.control.send(message)
        except OSError:
            return
