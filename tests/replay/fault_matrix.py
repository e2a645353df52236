"""Real 2-rank startups with every fault kind in every state where it applies, run a few at a
time; each leaves its own journal for the diagnosis tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lifecycle.core.format.states import State
from lifecycle.core.settings.faults import FAULTABLE_STATES, FaultKind

# Long enough that rank 0 decoding a video while rank 1 waits in the next collective does not
# time out on a loaded 2-core machine; short enough to keep the matrix quick.
DIST_TIMEOUT_S = 8
PARALLEL = 3
RUN_TIMEOUT_S = 150


@dataclass(frozen=True)
class Case:
    kind: FaultKind
    state: State

    @property
    def name(self) -> str:
        return f"{self.kind.value}-in-{self.state.value}"

    @property
    def spec(self) -> str:
        return f"1:{self.state.value}:{self.kind.value}"


# drop-buffers issues no collective, so there is nothing there to skip; over-budget fails no
# startup (every rank rolls back its residency plan: tests/lifecycle/test_residency_boot.py).
ALL_CASES = tuple(
    Case(kind=kind, state=state)
    for kind in FaultKind
    for state in FAULTABLE_STATES
    if kind is not FaultKind.OVER_BUDGET
    and not (kind is FaultKind.SKIP_COLLECTIVE and state is State.DROP_BUFFERS)
)
# What the test suite runs: `raise` in every state but re-warm (the field's failure and its
# kin), and each other kind where it acts differently (before calibration, in the probe) and
# where the agreed abort meets it. `python -m tests.replay.fault_matrix` runs ALL_CASES.
SUITE_STATES = {
    FaultKind.HANG: (State.GATE_CHECK,),
    FaultKind.EXIT: (State.PROBE,),
    FaultKind.SKIP_COLLECTIVE: (State.GATE_CHECK, State.BOUNDED_WARM),
}
CASES = tuple(
    c
    for c in ALL_CASES
    if (c.kind is FaultKind.RAISE and c.state is not State.RE_WARM)
    or c.state in SUITE_STATES.get(c.kind, ())
)


@dataclass(frozen=True)
class Produced:
    case: Case
    db: Path
    returncode: int | None
    seconds: float
    log: str


def command(case: Case, db: Path) -> list[str]:
    return [
        sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video",
        "--num-ranks", "2", "--calibrate", "--db", str(db), "--fault", case.spec,
        "--dist-timeout", str(DIST_TIMEOUT_S), "--heartbeat-interval", "0.2",
        "--log-level", "error",
    ]  # fmt: skip


def produce(root: Path, cases: tuple[Case, ...] = CASES) -> dict[str, Produced]:
    """Run every case (PARALLEL at a time), each bounded by RUN_TIMEOUT_S."""
    pending = list(cases)
    running: list[tuple[Case, subprocess.Popen[bytes], float, Path]] = []
    done: dict[str, Produced] = {}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    while pending or running:
        while pending and len(running) < PARALLEL:
            case = pending.pop(0)
            where = root / case.name
            where.mkdir(parents=True, exist_ok=True)
            log = (where / "boot.log").open("wb")
            proc = subprocess.Popen(
                command(case, where / "j.db"), cwd=where, stdout=log, stderr=subprocess.STDOUT,
                env=env,
            )  # fmt: skip
            log.close()
            running.append((case, proc, time.monotonic(), where))
        for item in list(running):
            case, proc, started, where = item
            elapsed = time.monotonic() - started
            if proc.poll() is None and elapsed < RUN_TIMEOUT_S:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            running.remove(item)
            done[case.name] = Produced(
                case=case,
                db=where / "j.db",
                returncode=proc.returncode,
                seconds=elapsed,
                log=(where / "boot.log").read_text(errors="replace"),
            )
        time.sleep(0.1)
    return done


if __name__ == "__main__":
    import json
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    started = time.monotonic()
    results = produce(root, ALL_CASES)
    print(f"{len(results)} runs in {time.monotonic() - started:.1f} s under {root}")
    for name, produced in sorted(results.items()):
        out = subprocess.run(
            [sys.executable, "-m", "replay", "diagnose", "latest", str(produced.db), "--json"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        doc = json.loads(out.stdout) if out.stdout.startswith("{") else {}
        print(f"{name:34} rc={produced.returncode} {produced.seconds:5.1f}s ->"
              f" {doc.get('outcome')} {doc.get('culprit_ranks')} {doc.get('culprit_state')}"
              f" | {[r['status'] for r in doc.get('ranks', [])]}")  # fmt: skip
