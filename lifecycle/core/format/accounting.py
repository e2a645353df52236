"""Every second of a rank's startup, from its launch to ready, given to a named phase (pure;
shared with replay, the console, the server and the trace exporter).

The phases, in order: `spawn` (the launcher's work before this rank's process began: none for
a rank that is its own launcher), the phases its process journaled at its start (the
interpreter, each library's import, opening the journal), then each action of each state as
the rank timed it (`gate-check/load-pipeline`). What is left between them (transitions, the
journal's own writes) is `unattributed`. Component loads happen inside `load-pipeline`, in
parallel: they are figures of their own, not phases, so nothing is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.format.events import LoadFinished, LoadStarted
from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.records import PhaseTime
from lifecycle.core.format.states import State
from lifecycle.core.format.text import format_bytes
from lifecycle.core.format.view import RankView

SPAWN = "spawn"
IMPORTS = "imports"  # what a run_started of version 2 measured whole


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadShare:
    """One component's load: its bytes, its time in all (so far, while it goes on), reading
    apart from moving to the device, and whether it ended well (None while it goes on)."""

    component: str
    files: int
    bytes: int
    seconds: float | None
    read_s: float | None
    device_s: float | None
    dtype: str | None
    ok: bool | None

    @property
    def ended(self) -> bool:
        return self.ok is not None

    @property
    def gb_per_s(self) -> float | None:
        """Bytes read per second of reading, in GB/s; None for a component built rather than
        read from files (a built-in model's)."""
        if not self.read_s or not self.bytes or not self.files:
            return None
        return self.bytes / self.read_s / 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class StartupAccount:
    """A rank's startup to `until` (its ready, or its last event when it never got there)."""

    rank: int
    total_s: float
    phases: tuple[PhaseTime, ...]
    loads: tuple[LoadShare, ...]
    ready: bool  # `until` is its ready; else the account of a startup that did not get there

    @property
    def attributed_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def unattributed_s(self) -> float:
        return self.total_s - self.attributed_s

    @property
    def unattributed_share(self) -> float:
        return self.unattributed_s / self.total_s if self.total_s > 0 else 0.0


def phase_name(state: str, action: str) -> str:
    return f"{state}/{action}"


def account(view: RankView, *, now: float | None = None) -> StartupAccount | None:
    """The rank's startup accounted to its ready; to `now` (or its last event) when it is not
    ready yet or never got there. None without a launch to count from (a journal before
    run_started version 2)."""
    launch = launch_phase(view)
    if launch is None:
        return None
    ready_at = view.entered_at(State.READY.value)
    until = ready_at if ready_at is not None else (now or view.last_wall or launch.created_at)
    phases: list[PhaseTime] = []
    if launch.spawn_s:
        phases.append(PhaseTime(name=SPAWN, seconds=launch.spawn_s))
    started = view.run_started
    if started is not None and started.phases:
        phases.extend(started.phases)
    elif launch.imports_s is not None:
        phases.append(PhaseTime(name=IMPORTS, seconds=launch.imports_s))
    for done in view.actions_done:
        if done.started_at < until:
            seconds = min(done.seconds, until - done.started_at)
            phases.append(PhaseTime(name=phase_name(done.state, done.action), seconds=seconds))
    if ready_at is None and view.action is not None and view.action_at is not None:
        # The action it is in now (or was in when it stopped): its time so far.
        state = view.spans[-1].state if view.spans else view.state
        phases.append(
            PhaseTime(
                name=phase_name(state, view.action.action),
                seconds=max(0.0, until - view.action_at),
            )
        )
    return StartupAccount(
        rank=view.rank,
        total_s=max(0.0, until - launch.launched_at),
        phases=tuple(phases),
        loads=loads_of(view, until=until),
        ready=ready_at is not None,
    )


def loads_of(view: RankView, *, until: float) -> tuple[LoadShare, ...]:
    """Each component's load, in the order they began; one still going on (or cut short) at
    `until` counts its time so far, with no end (`ok` None)."""
    begun: dict[str, LoadStarted] = {}
    shares: dict[str, LoadShare] = {}
    for at, _, event in view.loads:
        if isinstance(event, LoadStarted):
            begun[event.component] = event
            shares[event.component] = LoadShare(
                component=event.component,
                files=len(event.files),
                bytes=event.bytes,
                seconds=max(0.0, until - at),
                read_s=None,
                device_s=None,
                dtype=None,
                ok=None,
            )
        elif isinstance(event, LoadFinished):
            first = begun.get(event.component)
            shares[event.component] = LoadShare(
                component=event.component,
                files=len(first.files) if first is not None else 0,
                bytes=event.bytes,
                seconds=event.seconds,
                read_s=event.read_s,
                device_s=event.device_s,
                dtype=event.dtype,
                ok=event.ok,
            )
    return tuple(shares.values())


# -- in words and as JSON, for the console, replay, /lifecycle and the exporter --------------


def total_text(account: StartupAccount) -> str:
    """The startup's time and what no phase holds: "4.75 s from the launch to ready,
    unattributed 0.01 s (0.2 %)"."""
    to = "to ready" if account.ready else "so far (not ready)"
    return (
        f"{account.total_s:.2f} s from the launch {to}, unattributed"
        f" {account.unattributed_s:.2f} s ({account.unattributed_share * 100:.1f} %)"
    )


def phases_text(account: StartupAccount) -> str:
    """Each phase and its seconds, in order, in one line."""
    return ", ".join(f"{p.name} {p.seconds:.2f} s" for p in account.phases)


def load_text(load: LoadShare) -> str:
    """One component's load: "transformer 2.6 GiB in 1.93 s (read 1.90 s at 1.37 GB/s,
    bfloat16; to the device 0.03 s)"."""
    size = format_bytes(load.bytes)
    if load.seconds is None or load.ok is None:
        return f"{load.component} {size}, loading for {load.seconds or 0.0:.2f} s"
    rate = f" at {load.gb_per_s:.2f} GB/s" if load.gb_per_s is not None else ""
    dtype = f", {load.dtype}" if load.dtype else ""
    failed = "" if load.ok else ", failed"
    return (
        f"{load.component} {size} in {load.seconds:.2f} s (read {load.read_s or 0.0:.2f} s"
        f"{rate}{dtype}; to the device {load.device_s or 0.0:.2f} s{failed})"
    )


def account_json(account: StartupAccount) -> dict[str, object]:
    return {
        "total_s": account.total_s,
        "ready": account.ready,
        "unattributed_s": account.unattributed_s,
        "phases": [{"name": p.name, "seconds": p.seconds} for p in account.phases],
        "loads": [
            {
                "component": load.component,
                "bytes": load.bytes,
                "seconds": load.seconds,
                "read_s": load.read_s,
                "device_s": load.device_s,
                "gb_per_s": load.gb_per_s,
                "dtype": load.dtype,
                "files": load.files,
                "ok": load.ok,
            }
            for load in account.loads
        ],
    }
