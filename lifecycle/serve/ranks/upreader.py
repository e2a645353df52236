"""Rank 0's reader of one other rank under torchrun: its messages in the rendezvous store, in
order, each opened with the run's key and deleted once read, and its beat, whose stopping
says the rank is lost.

Anything that reaches the store can write there, at the keys a reader reads next. A value that
is not sealed for its slot is dropped and counted (once, however often it is read there again),
never deleted and never taken for the slot's message: the rank's own write replaces it. A
slot emptied or overwritten before it was read, while the rank went on to the next, is given
up once the next holds a sealed message, so that the rank's later messages still arrive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lifecycle.runtime.group.storetrust import NOT_A_MESSAGE, StoreTrust
from lifecycle.serve.ranks.crossnode import BEAT_S, LOST_S, SUSPECT_S
from lifecycle.serve.ranks.wire import (
    BEAT,
    UP,
    Up,
    beat_from_wire,
    beat_key,
    from_wire,
    message_key,
)

# How often the reader looks for the rank's next message (a store round trip of its own each
# time, milliseconds at most; a store's blocking wait logs a warning each time it times out).
READ_POLL_S = 0.01
GONE = "the message in this slot was removed or replaced before it was read"


class StoreReader:
    """Rank 0's reader of one other rank's messages in the store, in order, each deleted once
    read; the rank is lost once its beat counter has not moved for LOST_S."""

    def __init__(
        self,
        store: Any,
        *,
        trust: StoreTrust,
        rank: int,
        on_message: Callable[[Up], None],
        on_beat: Callable[[int], None],
        on_lost: Callable[[int, str], None],
    ) -> None:
        self._store = store
        self._trust = trust
        self._run_id = trust.key.run_id
        self._rank = rank
        self._on_message = on_message
        self._on_beat = on_beat
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
        # Judged only once the rank has beaten: until then it is starting (its node may come
        # up minutes after this one), and the rendezvous and the group's timeouts bound that.
        seq, beats, moved, looked = 0, 0, time.monotonic(), 0.0
        while not self._closed.is_set():
            try:
                if time.monotonic() - looked >= BEAT_S:
                    looked = time.monotonic()
                    now_beats = self._beat()
                    if now_beats > beats:
                        beats, moved = now_beats, looked
                        self._on_beat(self._rank)
                    if self._gone(seq):
                        seq += 1
                item = self._take(seq)
            except RuntimeError:
                item = None  # the store is gone: every rank's watcher sees that itself
            if item is None:
                silent_s = time.monotonic() - moved
                if beats and silent_s >= (SUSPECT_S if self._suspect.is_set() else LOST_S):
                    self._on_lost(self._rank, f"no beat for {silent_s:.1f} s")
                    return
                self._closed.wait(READ_POLL_S)
                continue
            seq += 1
            moved = time.monotonic()
            self._on_message(item)

    def _beat(self) -> int:
        """The rank's beat count, as it last sealed it (0 for none)."""
        key = beat_key(self._run_id, self._rank)
        if not self._store.check([key]):
            return 0
        raw = self._store.get(key)
        body = self._trust.open(raw, channel=BEAT, slot=key, rank=self._rank)
        count = None if body is None else beat_from_wire(body)
        if body is not None and count is None:
            self._trust.reject(BEAT, slot=key, data=raw, reason=NOT_A_MESSAGE)
        return count or 0

    def _read(self, seq: int) -> Up | None:
        """The message sealed for slot `seq`, if it holds one; what else it holds is dropped."""
        key = message_key(self._run_id, self._rank, seq)
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)
        body = self._trust.open(raw, channel=UP, slot=key, rank=self._rank, seq=seq)
        item = None if body is None else from_wire(body, run_id=self._run_id, rank=self._rank)
        if body is not None and item is None:
            self._trust.reject(UP, slot=key, data=raw, reason=NOT_A_MESSAGE)
        return item

    def _take(self, seq: int) -> Up | None:
        item = self._read(seq)
        if item is not None:
            self._store.delete_key(message_key(self._run_id, self._rank, seq))
        return item

    def _gone(self, seq: int) -> bool:
        """Whether slot `seq` lost its message: the rank wrote the next after it (the next
        holds a sealed message) and it holds none now."""
        if self._read(seq + 1) is None or self._read(seq) is not None:
            return False
        self._trust.reject(
            UP, slot=message_key(self._run_id, self._rank, seq), data=b"", reason=GONE
        )
        return True

    def close(self) -> None:
        self._closed.set()
