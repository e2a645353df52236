"""The control channel of `serve` under torchrun, where the ranks may be on other hosts: rank 0
answers HTTP, and its messages and the ranks' answers travel over torch.distributed.

Down (rank 0 to the ranks): a gloo group of every rank beside the model's groups, joined once
the ranks are ready. Rank 0 broadcasts each message with the ranks it is for, and a keep-alive
when it has none to send, so that a rank gone (its process killed, its host unreachable) is
found by the next broadcast failing. Up (each rank to rank 0): the rendezvous store every rank
already reaches (torchrun's agent's), one key per message in order, deleted once read: the
rank's journal events as it records them (so that rank 0 folds every rank's view whatever
journal each node writes to), its replies, and a beat counter that stops moving when the rank
is gone.

Every rank's `ControlInbox` reads and writes a `RankBridge` as it would the launcher's
connection; rank 0's server reads every rank through a `RankLine` per rank, as it reads a
spawned rank's connection.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lifecycle.core.codec import decode_or_unknown, dumps_record, encode, loads_record
from lifecycle.core.errors import CorruptEvent
from lifecycle.core.events import StoredEvent
from lifecycle.serve.control import FromRank, Hello, Lost, Progress, Ready, Result, ToRank

BEAT_S = 0.5  # how often each rank moves its beat counter
# A rank whose beat counter has not moved for this long is lost: its process or its host is
# gone (a beat is a thread's store request every BEAT_S, which a busy rank still makes).
LOST_S = 4.0
# Once a broadcast has failed, some rank is gone: a rank whose beat has not moved for this long
# is the one (a live rank's moves every BEAT_S).
SUSPECT_S = 1.5
KEEPALIVE_S = 1.0  # rank 0 broadcasts at least this often
# A broadcast that does not complete within this long fails on every rank: rank 0 broadcasts
# every KEEPALIVE_S, so this only bounds a rank's wait once rank 0 is gone without a word.
CONTROL_TIMEOUT_S = 30.0
# How often rank 0 looks for a rank's next message (a store round trip of its own each time,
# milliseconds at most; a store's blocking wait logs a warning each time it times out).
READ_POLL_S = 0.01

Up = FromRank | StoredEvent


def _prefix(run_id: str, rank: int) -> str:
    return f"lifecycle/{run_id}/serve/{rank}"


def message_key(run_id: str, rank: int, seq: int) -> str:
    return f"{_prefix(run_id, rank)}/up/{seq}"


def beat_key(run_id: str, rank: int) -> str:
    return f"{_prefix(run_id, rank)}/beat"


# -- the wire (up): JSON text, never unpickled --------------------------------------------------

_MESSAGES: dict[str, type[Hello | Ready | Progress | Result]] = {
    "hello": Hello,
    "ready": Ready,
    "progress": Progress,
    "result": Result,
}
_NAMES = {cls: name for name, cls in _MESSAGES.items()}


def to_wire(item: Up) -> bytes:
    if isinstance(item, StoredEvent):
        event = item.event
        doc: dict[str, Any] = {
            "type": "event",
            "seq": item.seq,
            "wall": item.wall_time,
            "mono_ns": item.mono_ns,
            "state": item.state,
            "kind": event.kind,
            "version": event.version,
            "payload": encode(event),
        }
        return json.dumps(doc).encode()
    return json.dumps({"type": _NAMES[type(item)], "message": dumps_record(item)}).encode()


def from_wire(data: bytes, *, run_id: str, rank: int) -> Up | None:
    """The message `data` holds from `rank`; None for anything else (any process that reaches
    the store could have written it), or a message that names another rank."""
    try:
        doc = json.loads(data)
        kind = doc["type"]
        if kind == "event":
            return StoredEvent(
                run_id=run_id,
                rank=rank,
                seq=int(doc["seq"]),
                wall_time=float(doc["wall"]),
                mono_ns=int(doc["mono_ns"]),
                state=str(doc["state"]),
                event=decode_or_unknown(str(doc["kind"]), int(doc["version"]), doc["payload"]),
            )
        message = loads_record(_MESSAGES[kind], doc["message"])
    except (ValueError, KeyError, TypeError, RecursionError, CorruptEvent):
        return None
    return message if message.rank == rank else None


# -- a rank's end ------------------------------------------------------------------------------


class RankBridge:
    """What a rank's ControlInbox reads and writes under torchrun: rank 0's messages, taken
    from the control group's broadcasts, and its own, published in the store (rank 0's go
    straight to its server, `deliver`)."""

    def __init__(
        self,
        rank: int,
        *,
        deliver: Callable[[Up], None] | None = None,
        on_group: Callable[[Any], None] | None = None,
    ) -> None:
        self.rank = rank
        self._on_group = on_group
        self._down: queue.Queue[ToRank | None] = queue.Queue()
        self._up: queue.Queue[Up] = queue.Queue()
        self._deliver = deliver if deliver is not None else self._up.put
        self._closed = threading.Event()
        self.run_id: str | None = None
        self._store: Any = None

    # The connection ControlInbox reads: a None in the queue is the channel gone.
    def recv(self) -> ToRank:
        message = self._down.get()
        if message is None:
            raise EOFError("rank 0's control channel is gone")
        return message

    def send(self, message: FromRank) -> None:
        self._deliver(message)

    def record(self, stored: StoredEvent) -> None:
        """The recorder's listener: every event this rank journals goes to rank 0 too."""
        self._deliver(stored)

    def put(self, message: ToRank | None) -> None:
        self._down.put(message)

    def publish(self, store: Any, run_id: str) -> None:
        """Start publishing this rank's messages and beats in `store` (a client of its own)."""
        self.run_id, self._store = run_id, store
        self.hello()
        threading.Thread(
            target=self._publish, args=(store, run_id), name="lifecycle-up", daemon=True
        ).start()

    def hello(self) -> None:
        self.send(Hello(rank=self.rank, host=socket.gethostname()))

    def _publish(self, store: Any, run_id: str) -> None:
        seq, beaten = 0, 0.0
        beat = beat_key(run_id, self.rank)
        while not self._closed.is_set():
            try:
                if time.monotonic() - beaten >= BEAT_S:
                    store.add(beat, 1)
                    beaten = time.monotonic()
                with contextlib.suppress(queue.Empty):
                    item = self._up.get(timeout=BEAT_S)
                    store.set(message_key(run_id, self.rank, seq), to_wire(item))
                    seq += 1
            except RuntimeError:
                return  # the store is gone: the abort watcher says so for the whole rank

    def join_control_group(self) -> None:
        """Join the control group with every other rank; then rank 0 broadcasts on it
        (`on_group`) and the others take its broadcasts."""
        group = join_control_group()
        if self._on_group is not None:
            self._on_group(group)
        else:
            threading.Thread(
                target=self._listen, args=(group,), name="lifecycle-down", daemon=True
            ).start()

    def _listen(self, group: Any) -> None:
        """Take rank 0's broadcasts until a stop for this rank, or until the group fails
        (rank 0 gone: read as the channel gone)."""
        import torch.distributed as dist

        from lifecycle.serve.control import Stop

        while not self._closed.is_set():
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=group)
            except RuntimeError as exc:
                self._rank_0_lost(exc)
                return
            targets, message = box[0]
            if message is None or self.rank not in targets:
                continue
            self._down.put(message)
            if isinstance(message, Stop):
                return

    def _rank_0_lost(self, exc: BaseException) -> None:
        """Rank 0's broadcasts stopped: its process or its host is gone, and with it the
        server. Not a stop (this rank would exit 0 and torchrun take the group for done): the
        loss is announced for the agreed abort, unless a failure was announced first (rank 0's
        own, or the store gone, which every rank's watcher sees itself), and the rank fails
        on it, which with the abort on is an abort naming that first failure."""
        from lifecycle.runtime.abort import announce, rank_lost

        text = str(exc).strip()
        failure = rank_lost(
            0,
            "rank 0 lost: the control group failed: "
            + (text.splitlines()[0][:200] if text else type(exc).__name__),
            state=None,
            announced_by="peer",
        )
        if self._store is not None and self.run_id is not None:
            with contextlib.suppress(RuntimeError):
                announce(self._store, self.run_id, failure)
        self._down.put(Lost(why=failure.message))

    def close(self) -> None:
        self._closed.set()


def join_control_group() -> Any:
    """The control group: every rank, on gloo whatever the model's backend; joined by every
    rank at once."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))


# -- rank 0's end ------------------------------------------------------------------------------


class RankLine:
    """Rank 0's server's connection to one rank: what it sends goes down (rank 0's own straight
    to its bridge, another's through the broadcaster); what `recv` gives is the rank's replies
    (its events go to `on_event`). Lost: recv raises EOFError."""

    def __init__(self, rank: int, send: Callable[[ToRank], None]) -> None:
        self.rank = rank
        self._send = send
        self._replies: queue.Queue[FromRank | None] = queue.Queue()
        self._gone = "is gone"

    def send(self, message: ToRank) -> None:
        self._send(message)

    def recv(self) -> FromRank:
        message = self._replies.get()
        if message is None:
            raise EOFError(self._gone)
        return message

    def reply(self, message: FromRank | None) -> None:
        self._replies.put(message)

    def close(self, why: str = "") -> None:
        """The rank is gone (`why`: how rank 0 knows)."""
        if why:
            self._gone = f"is gone: {why}"
        self._replies.put(None)


class Broadcaster:
    """Rank 0's side of the control group: each message once, with the ranks it is for, and a
    keep-alive when there is none. A broadcast that fails (a rank gone) is reported once to
    `on_broken` and ends the channel."""

    def __init__(self, on_broken: Callable[[str], None]) -> None:
        self._queue: queue.Queue[tuple[frozenset[int], ToRank] | None] = queue.Queue()
        self._on_broken = on_broken
        self._done = threading.Event()
        self.started = False
        self.ended = threading.Event()  # it broadcasts no more: stopped, closed or broken

    def send(self, targets: Iterable[int], message: ToRank) -> None:
        self._queue.put((frozenset(targets), message))

    def start(self, group: Any, others: frozenset[int]) -> None:
        """Broadcast on `group` until every one of `others` (the ranks but 0) was told to
        stop: they have left it."""
        self.started = True
        threading.Thread(
            target=self._run, args=(group, others), name="lifecycle-broadcast", daemon=True
        ).start()

    def _run(self, group: Any, others: frozenset[int]) -> None:
        try:
            self._broadcast(group, others)
        finally:
            self.ended.set()

    def _broadcast(self, group: Any, others: frozenset[int]) -> None:
        import torch.distributed as dist

        from lifecycle.serve.control import Stop

        stopped: set[int] = set()
        while not self._done.is_set():
            try:
                item = self._queue.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                item = (frozenset(), None)  # type: ignore[assignment]
            if item is None:
                return
            try:
                dist.broadcast_object_list([item], src=0, group=group)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self._on_broken(f"the control group failed: {first[:200]}")
                return
            if isinstance(item[1], Stop):
                stopped.update(item[0])
                if stopped >= others:
                    return

    def close(self) -> None:
        self._done.set()
        self._queue.put(None)


class StoreReader:
    """Rank 0's reader of one other rank's messages in the store, in order, each deleted once
    read; the rank is lost once its beat counter has not moved for LOST_S."""

    def __init__(
        self,
        store: Any,
        *,
        run_id: str,
        rank: int,
        on_message: Callable[[Up], None],
        on_beat: Callable[[int], None],
        on_lost: Callable[[int, str], None],
    ) -> None:
        self._store = store
        self._on_beat = on_beat
        self._run_id = run_id
        self._rank = rank
        self._on_message = on_message
        self._on_lost = on_lost
        self._closed = threading.Event()
        self._suspect = threading.Event()

    def start(self) -> None:
        threading.Thread(
            target=self._run, name=f"lifecycle-rank-{self._rank}-up", daemon=True
        ).start()

    def suspect(self) -> None:
        """A broadcast failed: take the rank for lost after SUSPECT_S without a beat."""
        self._suspect.set()

    def _run(self) -> None:
        store, rank = self._store, self._rank
        # Judged only once the rank has beaten: until then it is starting (its node may come
        # up minutes after this one), and the rendezvous and the group's timeouts bound that.
        seq, beats, moved, looked = 0, 0, time.monotonic(), 0.0
        beat = beat_key(self._run_id, rank)
        while not self._closed.is_set():
            key = message_key(self._run_id, rank, seq)
            try:
                if time.monotonic() - looked >= BEAT_S:
                    looked = time.monotonic()
                    now_beats = int(store.add(beat, 0))
                    if now_beats != beats:
                        beats, moved = now_beats, looked
                        self._on_beat(rank)
                data = store.get(key) if store.check([key]) else None
                if data is not None:
                    store.delete_key(key)
            except RuntimeError:
                data = None  # the store is gone: every rank's watcher sees that itself
            if data is None:
                silent_s = time.monotonic() - moved
                if beats and silent_s >= (SUSPECT_S if self._suspect.is_set() else LOST_S):
                    self._on_lost(rank, f"no beat for {silent_s:.1f} s")
                    return
                self._closed.wait(READ_POLL_S)
                continue
            seq += 1
            moved = time.monotonic()
            message = from_wire(data, run_id=self._run_id, rank=rank)
            if message is not None:
                self._on_message(message)

    def close(self) -> None:
        self._closed.set()
