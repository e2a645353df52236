"""Rank 0's reader of another rank under torchrun (docs/nodes.md), through a
real store: messages that are not sealed with the run's store key, written at the slots it
reads next, are dropped and counted, never taken for the rank's own; a slot emptied behind
its back does not stop the stream; beats forged or replayed do not keep a silent rank alive."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from lifecycle.runtime.group.storetrust import RunKey, StoreTrust
from lifecycle.serve.ranks import crossnode
from lifecycle.serve.ranks.messages import Progress, Result
from lifecycle.serve.ranks.upreader import StoreReader
from lifecycle.serve.ranks.wire import UP, beat_key, message_key, to_wire
from tests.conftest import wait_until
from tests.lifecycle.test_store_trust import KEY, client


class Reading:
    """Rank 0's reader of rank 1 of run "r" on a real store on 127.0.0.1, with `rank`, the
    rank's own sealed writes, and `forger`, a client without the key."""

    def __init__(self) -> None:
        from lifecycle.runtime.group.abort import host_store

        self.store = host_store(world_size=1)
        self.trust = StoreTrust(RunKey(KEY.encode(), run_id="r"))
        self.rank, self.forger = client(self.store.port), client(self.store.port)
        self.messages: list[Any] = []
        self.lost: list[str] = []
        self.judged = threading.Event()
        self.beaten = threading.Event()  # the reader saw the rank beat
        self.beats = 0
        self.reader = StoreReader(
            client(self.store.port), trust=self.trust, rank=1, on_message=self.messages.append,
            on_beat=lambda rank: self.beaten.set(), on_lost=self._on_lost,
        )  # fmt: skip

    def _on_lost(self, rank: int, why: str) -> None:
        self.lost.append(f"rank {rank}: {why}")
        self.judged.set()

    def write(self, seq: int, item: Any) -> None:
        sealed = self.trust.key.seal(to_wire(item), channel=UP, rank=1, seq=seq)
        self.rank.set(message_key("r", 1, seq), sealed)

    def beat(self) -> bytes:
        self.beats += 1
        sealed = self.trust.key.seal(str(self.beats).encode(), channel="beat", rank=1)
        self.rank.set(beat_key("r", 1), sealed)
        return sealed


@contextlib.contextmanager
def reading() -> Iterator[Reading]:
    read = Reading()
    read.reader.start()
    try:
        yield read
    finally:
        read.reader.close()


def progress(step: int) -> Progress:
    return Progress(request_id="q1", rank=1, step=step)


def test_forged_and_garbled_messages_at_the_next_slots_are_dropped_and_the_real_ones_arrive() -> (
    None
):
    """A forged reply (unsealed, as anything that reaches the store could write it) and
    garbage at the slots the reader reads next are dropped and counted once each, however
    often they are read again, never taken for a message nor deleted; the rank's own sealed
    messages, written over them, arrive in order; a message replayed in another slot is
    dropped too."""
    with reading() as read:
        forged = Result(request_id="q1", rank=1, ok=False, error="forged", error_kind="exception")
        read.forger.set(message_key("r", 1, 0), to_wire(forged))
        read.forger.set(message_key("r", 1, 1), b"\x80\x04garbage")
        counts = read.trust.rejections.counts
        wait_until(lambda: counts().get(UP) == 2, within=5, what="the forgery and the garbage")
        time.sleep(0.6)  # read again and again meanwhile: the same two messages
        assert counts() == {UP: 2} and read.messages == []
        read.write(0, progress(0))
        wait_until(lambda: len(read.messages) == 1, within=5, what="the rank's first message")
        replayed = read.trust.key.seal(to_wire(progress(0)), channel=UP, rank=1, seq=0)
        read.forger.set(message_key("r", 1, 2), replayed)
        read.write(1, progress(1))
        wait_until(lambda: counts().get(UP) == 3, within=5, what="the replay")
        read.write(2, progress(2))
        wait_until(lambda: len(read.messages) == 3, within=5, what="the rank's messages")
    assert read.messages == [progress(0), progress(1), progress(2)]
    assert counts() == {UP: 3}


def test_a_slot_emptied_before_it_was_read_is_given_up_and_later_messages_still_arrive() -> None:
    """A message deleted from its slot by another client before rank 0 read it, while the
    rank went on to the next, is counted as lost and skipped: the stream does not stop at it."""
    with reading() as read:
        read.write(0, progress(0))
        wait_until(lambda: len(read.messages) == 1, within=5, what="the first message")
        read.reader.close()  # hold the reader while a slot is emptied behind its back
    with contextlib.ExitStack() as stack:
        resumed = StoreReader(
            client(read.store.port), trust=read.trust, rank=1, on_message=read.messages.append,
            on_beat=lambda rank: None, on_lost=lambda rank, why: None,
        )  # fmt: skip
        read.write(0, progress(10))
        read.forger.delete_key(message_key("r", 1, 0))
        read.write(1, progress(11))
        resumed.start()
        stack.callback(resumed.close)
        wait_until(lambda: len(read.messages) == 2, within=5, what="the message after the gap")
    assert read.messages == [progress(0), progress(11)]
    assert read.trust.rejections.counts() == {UP: 1}


def test_forged_and_replayed_beats_do_not_keep_a_silent_rank_alive() -> None:
    """A rank that beat and then went silent is lost within LOST_S and a second, however
    busily another client writes beats for it (unsealed counts, or its own last beat replayed);
    each distinct forged beat is counted."""
    with reading() as read:
        last = read.beat()
        assert read.beaten.wait(5), "the reader never saw the rank's beat"
        stop = threading.Event()

        def forge() -> None:
            """Counts going up for half the time the rank has, then its own last beat."""
            count, until = 10**6, time.monotonic() + crossnode.LOST_S / 2
            while not stop.is_set():
                count += 1
                forged = str(count).encode() if time.monotonic() < until else last
                read.forger.set(beat_key("r", 1), forged)
                time.sleep(0.05)

        forger = threading.Thread(target=forge, daemon=True)
        started = time.monotonic()
        forger.start()
        try:
            assert read.judged.wait(crossnode.LOST_S + 5.0), "a silent rank was kept alive"
        finally:
            stop.set()
            forger.join(5)
        assert time.monotonic() - started < crossnode.LOST_S + 2.0
        assert read.lost[0].startswith("rank 1: no beat for"), read.lost
        assert read.trust.rejections.counts()["beat"] >= 2
