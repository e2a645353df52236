"""The control channel of `serve` under torchrun, where the ranks may be on other hosts: rank 0
answers HTTP, and its messages and the ranks' answers travel over torch.distributed.

Down (rank 0 to the ranks): a gloo group of every rank beside the model's groups, joined once
the ranks are ready. Rank 0 broadcasts each message with the ranks it is for, and a keep-alive
when it has none to send, so that a rank gone (its process killed, its host unreachable) is
found by the next broadcast failing. Up (each rank to rank 0): the rendezvous store every rank
already reaches (torchrun's agent's), one key per message in order, deleted once read: the
rank's journal events as it records them (so that rank 0 folds every rank's view whatever
journal each node writes to), its replies, and a beat counter that stops moving when the rank
is gone (read by lifecycle.serve.ranks.upreader). Every message either way is sealed with the run's
store key (lifecycle.serve.ranks.wire); one that is not is dropped, counted and journaled once.

A rank whose own beats stopped for LOST_S (its process stopped, then resumed) knows the group
has gone on without it: it fails, however rank 0's last orders read.

Every rank's `ControlInbox` reads and writes a `RankBridge` as it would the launcher's
connection; rank 0's server reads every rank through a `RankLine` per rank, as it reads a
spawned rank's connection.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lifecycle.core.format.events import StoredEvent
from lifecycle.runtime.group.storetrust import NOT_A_MESSAGE, RunKey, StoreTrust
from lifecycle.serve.ranks.messages import FromRank, Hello, Lost, Stop, ToRank
from lifecycle.serve.ranks.wire import (
    BEAT,
    DOWN,
    UP,
    Up,
    beat_key,
    message_key,
    order_from_wire,
    order_to_wire,
    to_wire,
)

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
        self._store: Any = None
        self._trust: StoreTrust | None = None
        self._beaten: float | None = None  # monotonic time of its last beat, while it beats
        self._silent_s: float | None = None  # the gap in its beats that lost it, once found

    # The connection ControlInbox reads: a None in the queue is the channel gone.
    def recv(self) -> ToRank:
        message = self._down.get()
        # Rank 0's stop, its loss or the channel gone, read after a silence of this rank's own
        # that the group takes for lost: the group had gone on without this rank, which is
        # the failure, whichever of its threads saw the end first.
        ending = message is None or isinstance(message, Stop | Lost)
        if ending and not (isinstance(message, Lost) and message.rank == self.rank):
            why = self.taken_for_lost()
            if why is not None:
                return Lost(why=why, rank=self.rank)
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

    def publish(self, store: Any, trust: StoreTrust) -> None:
        """Start publishing this rank's messages and beats in `store` (a client of its own),
        sealed with the run's key."""
        self._store, self._trust = store, trust
        self.hello()
        threading.Thread(target=self._publish, name="lifecycle-up", daemon=True).start()

    def hello(self) -> None:
        self.send(Hello(rank=self.rank, host=socket.gethostname()))

    def taken_for_lost(self) -> str | None:
        """Why the group has gone on without this rank, if it has: its beats stopped for
        LOST_S (its process stopped or starved), which rank 0 takes for a rank lost."""
        silent, beaten = self._silent_s, self._beaten
        if silent is None and beaten is not None and time.monotonic() - beaten >= LOST_S:
            silent = time.monotonic() - beaten
        if silent is None:
            return None
        return (
            f"rank {self.rank} made no beat for {silent:.1f} s (its process was stopped or"
            f" starved): the group takes a rank silent for {LOST_S:g} s for lost"
        )

    def _publish(self) -> None:
        store, trust = self._store, self._trust
        assert trust is not None
        run_id, seal = trust.key.run_id, trust.key.seal
        seq, beats, beaten = 0, 0, 0.0
        beat = beat_key(run_id, self.rank)
        while not self._closed.is_set():
            try:
                if time.monotonic() - beaten >= BEAT_S:
                    self._check_gap()
                    beats += 1
                    store.set(beat, seal(str(beats).encode(), channel=BEAT, rank=self.rank))
                    beaten = self._beaten = time.monotonic()
                with contextlib.suppress(queue.Empty):
                    item = self._up.get(timeout=BEAT_S)
                    sealed = seal(to_wire(item), channel=UP, rank=self.rank, seq=seq)
                    store.set(message_key(run_id, self.rank, seq), sealed)
                    seq += 1
            except RuntimeError:
                # The store is gone: the abort watcher says so for the whole rank. A rank that
                # finds it gone after a silence of its own was lost before that.
                self._check_gap()
                break
        self._beaten = None  # no longer beating: its silence from now on says nothing

    def _check_gap(self) -> None:
        """Before a beat: one that comes LOST_S after the last is too late; the group has gone
        on without this rank, which fails (once)."""
        why = self.taken_for_lost()
        if why is not None and self._silent_s is None:
            assert self._beaten is not None
            self._silent_s = time.monotonic() - self._beaten
            self._down.put(Lost(why=why, rank=self.rank))

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
        """Take rank 0's broadcasts, each sealed for its place in the sequence, until a stop
        for this rank, or until the group fails (rank 0 gone: read as the channel gone)."""
        from lifecycle.runtime.group.process_group import broadcast_bytes

        trust = self._trust
        assert trust is not None
        seq = 0
        while not self._closed.is_set():
            try:
                data = broadcast_bytes(None, group=group)
            except (RuntimeError, ValueError) as exc:
                self._rank_0_lost(exc)
                return
            slot, seq = f"control broadcast {seq}", seq + 1
            body = trust.open(data, channel=DOWN, slot=slot, rank=0, seq=seq - 1)
            order = None if body is None else order_from_wire(body)
            if order is None:
                if body is not None:
                    trust.reject(DOWN, slot=slot, data=data, reason=NOT_A_MESSAGE)
                continue
            targets, message = order
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
        from lifecycle.runtime.group.abort import announce, rank_lost

        text = str(exc).strip()
        failure = rank_lost(
            0,
            "rank 0 lost: the control group failed: "
            + (text.splitlines()[0][:200] if text else type(exc).__name__),
            state=None,
            announced_by="peer",
        )
        if self._store is not None and self._trust is not None:
            with contextlib.suppress(RuntimeError):
                announce(self._store, self._trust, failure)
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
    keep-alive when there is none, each sealed with the run's key for its place in the
    sequence. A broadcast that fails (a rank gone) is reported once to `on_broken` and ends
    the channel."""

    def __init__(self, on_broken: Callable[[str], None]) -> None:
        self._queue: queue.Queue[tuple[frozenset[int], ToRank | None] | None] = queue.Queue()
        self._on_broken = on_broken
        self._done = threading.Event()
        self.started = False
        self.ended = threading.Event()  # it broadcasts no more: stopped, closed or broken

    def send(self, targets: Iterable[int], message: ToRank) -> None:
        self._queue.put((frozenset(targets), message))

    def start(self, group: Any, others: frozenset[int], key: RunKey) -> None:
        """Broadcast on `group` until every one of `others` (the ranks but 0) was told to
        stop: they have left it."""
        self.started = True
        threading.Thread(
            target=self._run, args=(group, others, key), name="lifecycle-broadcast", daemon=True
        ).start()

    def _run(self, group: Any, others: frozenset[int], key: RunKey) -> None:
        try:
            self._broadcast(group, others, key)
        finally:
            self.ended.set()

    def _broadcast(self, group: Any, others: frozenset[int], key: RunKey) -> None:
        from lifecycle.runtime.group.process_group import broadcast_bytes

        stopped: set[int] = set()
        seq = 0
        while not self._done.is_set():
            try:
                item = self._queue.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                item = (frozenset(), None)
            if item is None:
                return
            sealed = key.seal(order_to_wire(*item), channel=DOWN, rank=0, seq=seq)
            seq += 1
            try:
                broadcast_bytes(sealed, group=group)
            except (RuntimeError, ValueError) as exc:
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
