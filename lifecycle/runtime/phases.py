"""A rank's startup phases as they happen: the marks its process makes before its journal opens
(the interpreter's start, each library's import), and each pipeline component's load, journaled
through the recorder its startup sets while the pipeline is built.

Nothing here imports torch: the entry points mark their phases before they import it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import lifecycle
from lifecycle.core.format.events import Event, LoadFinished, LoadStarted
from lifecycle.core.format.records import PhaseTime

MAX_LOAD_FILES = 32  # a component's files a load_started event names (shards beyond are counted)
# The phases an entry point marks, in the order they come.
PYTHON_PHASE = "start Python"  # from the process's start to the lifecycle's first line
IMPORT_LIFECYCLE = "import lifecycle"  # its modules, to the entry function
# The settings and the model's spec: the command line and its config file, a plug-in's import,
# or diffusers and the model directory's configs.
MODEL_SPEC = "read settings"
# A model by hub ID that its cache did not hold: its files downloaded (between two reads of
# the settings, the second the downloaded snapshot's configs).
DOWNLOAD_MODEL = "download model"
OPEN_JOURNAL = "open journal"
IMPORT_TORCH = "import torch"
IMPORT_RUNTIME = "import runtime"  # the lifecycle's rank modules (torch's own is before)
AGREE_RUN_ID = "agree run id"  # under torchrun: the ranks' rendezvous for one run id
SETUP_PHASE = "set up rank"  # from the last mark to the rank's first event

# Each mark ends the phase it names, at a wall time (time.time()): the process's phases before
# its journal opened, in order.
_MARKS: list[tuple[str, float]] = []
_MARKS_LOCK = threading.Lock()


def mark(phase: str, *, at: float | None = None) -> None:
    """The phase `phase` of this process ends now (or `at`): it began where the last ended."""
    with _MARKS_LOCK:
        _MARKS.append((phase, time.time() if at is None else at))


def phases_until(started: float | None, until: float) -> tuple[PhaseTime, ...]:
    """This process's phases from its start (`started`, its /proc start time) to `until` (its
    first event): Python's start, each mark's phase, and the rest as setting up the rank. A
    mark before the process's start (a clock read a tick apart) counts from the start."""
    if started is None:
        return ()
    phases, since = [], started
    with _MARKS_LOCK:
        marks = [(PYTHON_PHASE, lifecycle.ENTERED_AT), *_MARKS]
    for name, marked in marks:
        at = min(max(marked, since), until)
        phases.append(PhaseTime(name=name, seconds=at - since))
        since = at
    phases.append(PhaseTime(name=SETUP_PHASE, seconds=max(0.0, until - since)))
    return tuple(phases)


class LoadSink(Protocol):
    def record(self, event: Event) -> object: ...


_SINK: list[LoadSink | None] = [None]


@contextmanager
def recording_loads(sink: LoadSink) -> Iterator[None]:
    """Journal every component load made in this process through `sink` (the pipeline's
    build at gate-check), from whichever thread loads it."""
    _SINK[0] = sink
    try:
        yield
    finally:
        _SINK[0] = None


class ComponentLoad:
    """One component's load as it goes: where reading (and building the module) ended and its
    move to the device began, and the dtype it ends up holding."""

    def __init__(self, nbytes: int) -> None:
        self.read_until: float | None = None
        self.dtype: str | None = None
        self.nbytes = nbytes

    def read_done(self, *, dtype: object = None, nbytes: int | None = None) -> None:
        """Reading (or building) is over; what follows is the move to the device. `nbytes`
        gives its size where the files did not (a module built, not read)."""
        self.read_until = time.perf_counter()
        if dtype is not None:
            self.dtype = str(dtype).removeprefix("torch.")
        if nbytes is not None:
            self.nbytes = nbytes


@contextmanager
def component_load(
    component: str, *, files: Sequence[str] = (), nbytes: int = 0
) -> Iterator[ComponentLoad]:
    """Time one component's load and, inside a startup, journal it: `load_started` (its files
    and bytes) before it reads, `load_finished` (seconds, read and device time, dtype, ok)
    after, whether it ended well or not."""
    sink = _SINK[0]
    if sink is not None:
        sink.record(
            LoadStarted(component=component, files=tuple(files[:MAX_LOAD_FILES]), bytes=nbytes)
        )
    load = ComponentLoad(nbytes)
    started = time.perf_counter()
    ok = False
    try:
        yield load
        ok = True
    finally:
        ended = time.perf_counter()
        read_until = load.read_until if load.read_until is not None else ended
        if sink is not None:
            sink.record(
                LoadFinished(
                    component=component,
                    seconds=ended - started,
                    read_s=read_until - started,
                    device_s=ended - read_until,
                    bytes=load.nbytes,
                    dtype=load.dtype,
                    ok=ok,
                )
            )
