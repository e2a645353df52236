"""What a keeper holds: each weights key's files, who maps them, when last used, and which to
let go when new weights would pass the memory budget (least recently used first, never one a
live rank holds)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (its /proc stat's 22nd field), which tells a live
    process from a later one given the same pid; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split() if ")" in text else []
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None  # ended (a zombie not yet reaped holds no mapping)
    return fields[19]


@dataclass(slots=True, kw_only=True)
class Held:
    """One weights key's files as the keeper holds them (open: that is what keeps them)."""

    key: str
    skeleton_fd: int
    skeleton_bytes: int
    blob_fd: int
    blob_bytes: int
    signature: str
    last_used: float
    holders: dict[int, str] = field(default_factory=dict)  # pid: its start time

    @property
    def nbytes(self) -> int:
        return self.skeleton_bytes + self.blob_bytes

    def live_holders(self) -> int:
        """The ranks that still map these weights (dead ones forgotten)."""
        for pid, began in list(self.holders.items()):
            if process_start(pid) != began:
                del self.holders[pid]
        return len(self.holders)

    def hold_for(self, pid: int) -> None:
        began = process_start(pid)
        if began is not None:
            self.holders[pid] = began

    def close(self) -> None:
        for fd in (self.skeleton_fd, self.blob_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(slots=True, kw_only=True)
class Holdings:
    budget_bytes: int
    held: dict[str, Held] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(h.nbytes for h in self.held.values())

    def to_evict(self, nbytes: int) -> list[Held] | None:
        """The holdings to let go (least recently used first, none a live rank maps) so that
        `nbytes` more fit the budget; None when they cannot."""
        free = self.budget_bytes - self.used_bytes
        if free >= nbytes:
            return []
        chosen = []
        for held in sorted(self.held.values(), key=lambda h: h.last_used):
            if held.live_holders():
                continue
            chosen.append(held)
            free += held.nbytes
            if free >= nbytes:
                return chosen
        return None

    def pop(self, key: str) -> Held | None:
        return self.held.pop(key, None)
