"""`lifecycle keeper`: the host's keeper of finished weights. It listens on a Unix socket only
its user may open (mode 0600, in a folder of mode 0700), answers signed requests (attach,
keep, drop, status) one connection each, holds what it is given within its memory budget, and
journals its life in the journal's `keeper_log`."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import socketserver
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from lifecycle.core.errors import ConfigError, JournalError
from lifecycle.runtime.keeping.keeperwire import (
    KeeperKey,
    KeeperUnavailable,
    private_socket,
    receive,
    send,
)
from lifecycle.serve.keeper.holdings import Held, Holdings, process_start
from lifecycle.store.journal import Journal
from lifecycle.store.keeperlog import (
    KeeperRow,
    append_keeper_rows,
    previous_keeper,
    started_detail,
)

log = structlog.get_logger("lifecycle.keeper")
_CRED = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid
# How long a claim to give a key's weights holds while its rank lives (a pack of many GB).
CLAIM_S = 600.0


class Keeper:
    """The keeper's holdings and its journal, behind one lock."""

    def __init__(self, *, key: KeeperKey, budget_bytes: int, journal: Journal | None) -> None:
        self.key = key
        self.holdings = Holdings(budget_bytes=budget_bytes)
        self.journal = journal
        self.lock = threading.Lock()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._rows: queue.Queue[KeeperRow | None] = queue.Queue()
        # key: the rank giving its weights (pid, its start time, when it claimed)
        self._claims: dict[str, tuple[int, str | None, float]] = {}
        self._writer = threading.Thread(target=self._write_rows, name="keeper-journal", daemon=True)
        self._writer.start()

    def note(
        self, what: str, *, key: str | None = None, nbytes: int = 0, detail: str | None = None
    ) -> None:
        """Journal one row of the keeper's life, off the answer's path (a thread writes them in
        order); a journal that cannot be written is said in the log and the keeper goes on (the
        weights matter more than their record)."""
        row = KeeperRow(
            host=self.host,
            keeper_pid=self.pid,
            wall=time.time(),
            what=what,
            key=key,
            bytes=nbytes,
            detail=detail,
        )
        log.info("keeper_" + what, key=key, bytes=nbytes, detail=detail)
        if self.journal is not None:
            self._rows.put(row)

    def _write_rows(self) -> None:
        """Append the rows noted, a batch at a time, until the stop's None."""
        stopping = False
        while not stopping:
            batch = [self._rows.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._rows.get_nowait())
            stopping = None in batch
            rows = [row for row in batch if row is not None]
            if rows and self.journal is not None:
                try:
                    append_keeper_rows(self.journal, rows)
                except JournalError as exc:
                    log.warning("keeper_journal_failed", error=str(exc))
            for _ in batch:
                self._rows.task_done()

    def settle(self) -> None:
        """Wait until every row noted so far is journaled (its start, before it answers)."""
        self._rows.join()

    def flush(self) -> None:
        """Every row noted so far journaled (at the keeper's stop)."""
        self._rows.put(None)
        self._writer.join(timeout=30)

    def answer(
        self, header: dict[str, Any], fds: list[int], peer_pid: int
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The answer to one verified request (and the files to pass with it)."""
        op = header.get("op")
        key = header.get("key")
        if op == "status":
            return self._status(), ()
        if not isinstance(key, str) or not key:
            return {"error": "no weights key"}, ()
        with self.lock:
            if op == "attach":
                return self._attach(key, peer_pid)
            if op == "claim":
                return self._claim(key, peer_pid), ()
            if op == "keep":
                return self._keep(key, header, fds, peer_pid)
            if op == "drop":
                held = self.holdings.pop(key)
                if held is not None:
                    held.close()
                    self.note(
                        "dropped",
                        key=key,
                        nbytes=held.nbytes,
                        detail=str(header.get("why", ""))[:500],
                    )
                return {"dropped": held is not None}, ()
        return {"error": f"unknown request {str(op)[:40]!r}"}, ()

    def _status(self) -> dict[str, Any]:
        with self.lock:
            held = [
                {
                    "key": h.key,
                    "bytes": h.nbytes,
                    "ranks": h.live_holders(),
                    "last_used": h.last_used,
                }
                for h in self.holdings.held.values()
            ]
            return {
                "budget": self.holdings.budget_bytes,
                "used": self.holdings.used_bytes,
                "held": held,
            }

    def _attach(self, key: str, peer_pid: int) -> tuple[dict[str, Any], tuple[int, ...]]:
        held = self.holdings.held.get(key)
        if held is None:
            return {"held": False}, ()
        held.last_used = time.time()
        held.hold_for(peer_pid)
        self.note("handed", key=key, nbytes=held.nbytes, detail=f"pid {peer_pid}")
        return self._held_answer(held), (held.skeleton_fd, held.blob_fd)

    @staticmethod
    def _held_answer(held: Held) -> dict[str, Any]:
        return {
            "held": True,
            "skeleton_bytes": held.skeleton_bytes,
            "blob_bytes": held.blob_bytes,
            "signature": held.signature,
        }

    def _claim(self, key: str, peer_pid: int) -> dict[str, Any]:
        """Whether `peer_pid` is the rank to give `key`'s weights: not when they are held, nor
        while another live rank has the claim (for CLAIM_S at most); so that one rank of a
        host packs them, not every one."""
        if key in self.holdings.held:
            return {"claimed": False, "held": True}
        pid, began, at = self._claims.get(key, (0, None, 0.0))
        if pid and process_start(pid) == began and time.time() - at < CLAIM_S:
            return {"claimed": False, "held": False}
        self._claims[key] = (peer_pid, process_start(peer_pid), time.time())
        return {"claimed": True}

    def _keep(
        self, key: str, header: dict[str, Any], fds: list[int], peer_pid: int
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        self._claims.pop(key, None)
        held = self.holdings.held.get(key)
        if held is not None:  # another rank kept them first: this one maps that copy
            _close(fds)
            held.last_used = time.time()
            held.hold_for(peer_pid)
            return {"outcome": "held", **self._held_answer(held)}, (held.skeleton_fd, held.blob_fd)
        sizes = header.get("skeleton_bytes"), header.get("blob_bytes")
        signature = header.get("signature")
        if (
            len(fds) != 2
            or not all(isinstance(n, int) and n >= 0 for n in sizes)
            or not isinstance(signature, str)
        ):
            _close(fds)
            return {
                "error": "a keep names its two files, their sizes and the skeleton's signature"
            }, ()
        skeleton_bytes, blob_bytes = int(sizes[0]), int(sizes[1])  # type: ignore[arg-type]
        if any(not stat.S_ISREG(os.fstat(fd).st_mode) for fd in fds) or (
            os.fstat(fds[0]).st_size < skeleton_bytes or os.fstat(fds[1]).st_size < blob_bytes
        ):
            _close(fds)
            return {"error": "the files passed are not the sizes named"}, ()
        evict = self.holdings.to_evict(skeleton_bytes + blob_bytes)
        if evict is None:
            _close(fds)
            detail = (
                f"{skeleton_bytes + blob_bytes:,} bytes more would pass the budget"
                f" ({self.holdings.used_bytes:,} of {self.holdings.budget_bytes:,} held for live"
                " ranks)"
            )
            self.note("refused", key=key, nbytes=skeleton_bytes + blob_bytes, detail=detail)
            return {"outcome": "refused", "reason": detail}, ()
        for gone in evict:
            self.holdings.pop(gone.key)
            gone.close()
            self.note("evicted", key=gone.key, nbytes=gone.nbytes, detail="least recently used")
        held = Held(
            key=key,
            skeleton_fd=fds[0],
            skeleton_bytes=skeleton_bytes,
            blob_fd=fds[1],
            blob_bytes=blob_bytes,
            signature=signature,
            last_used=time.time(),
        )
        held.hold_for(peer_pid)
        self.holdings.held[key] = held
        self.note("holds", key=key, nbytes=held.nbytes, detail=f"from pid {peer_pid}")
        return {"outcome": "kept"}, ()

    def close(self) -> None:
        with self.lock:
            for held in list(self.holdings.held.values()):
                held.close()
            self.holdings.held.clear()


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(10.0)
        keeper = self.server.keeper
        pid, uid, _ = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        )
        try:
            header, fds = receive(sock)
        except KeeperUnavailable:
            return
        if uid != os.getuid() or not keeper.key.checks(header):
            _close(fds)
            self._reply({"error": "a request that is not signed with the keeper key"}, ())
            return
        answer, passed = keeper.answer(header, fds, pid)
        self._reply(answer, passed)

    def _reply(self, answer: dict[str, Any], fds: tuple[int, ...]) -> None:
        with contextlib.suppress(OSError):
            send(self.request, self.server.keeper.key.signed(answer), fds)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    keeper: Keeper


@contextlib.contextmanager
def listening(path: Path, keeper: Keeper) -> Iterator[_Server]:
    """The keeper's server on `path` (its folder made 0700, the socket 0600); ConfigError in
    one line where another keeper answers there or the place is not the user's own."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = folder.stat()
    if status.st_uid != os.getuid() or stat.S_IMODE(status.st_mode) & 0o077:
        raise ConfigError(
            f"--socket {path}: its folder must be this user's own and closed to others"
            f" (mode 0700, it is {stat.S_IMODE(status.st_mode):o})",
            field="socket",
        )
    if path.exists() or path.is_symlink():
        if private_socket(path) is None and _answers(path):
            raise ConfigError(f"--socket {path}: a keeper already listens there", field="socket")
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(
                f"--socket {path}: a file that is not a socket is there", field="socket"
            )
        path.unlink()  # a socket left behind by a keeper that ended without stopping
    old = os.umask(0o177)
    try:
        server = _Server(str(path), _Handler)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.keeper = keeper
    try:
        yield server
    finally:
        server.server_close()
        with contextlib.suppress(OSError):
            path.unlink()


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def run_keeper(path: Path, keeper: Keeper, *, ready: threading.Event | None = None) -> int:
    """Serve until SIGTERM or SIGINT; journal the start (and what an earlier keeper lost) and
    the stop."""
    where = str(path.absolute())
    with listening(path, keeper) as server:
        if keeper.journal is not None:
            try:
                before = previous_keeper(keeper.journal, host=keeper.host, socket=where)
            except JournalError:
                before = None
            if before is not None:
                row, held = before
                keeper.note(
                    "lost",
                    detail=f"keeper pid {row.keeper_pid} ended without stopping, holding {held}"
                    " weights key(s): the ranks that mapped them keep them; the next startups load",
                )
        keeper.note("started", nbytes=keeper.holdings.budget_bytes, detail=started_detail(where))
        keeper.settle()
        stop = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        if ready is not None:
            ready.set()
        print(
            f"lifecycle keeper: listening on {path},"
            f" budget {keeper.holdings.budget_bytes / 2**30:.1f} GiB",
            flush=True,
        )
        server.serve_forever(poll_interval=0.2)
        keeper.note("stopped", nbytes=keeper.holdings.used_bytes)
        keeper.flush()
        keeper.close()
    return 0
