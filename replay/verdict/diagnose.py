"""The verdict on a run read from its journals (`lifecycle.verdict.diagnose`), with the
collectives only PyTorch's Flight Recorder saw, and the exit status it gives a command."""

from __future__ import annotations

from typing import TypeAlias

from lifecycle.verdict import diagnose as verdict
from lifecycle.verdict.outcome import Outcome
from lifecycle.verdict.status import RankVerdict
from replay.exits import ReplayExit
from replay.flight.join import FlightFacts, in_flight
from replay.load import RunInfo
from replay.verdict.analysis import RunAnalysis

Diagnosis: TypeAlias = verdict.Diagnosis[RunInfo]

__all__ = ["Diagnosis", "Outcome", "diagnose", "exit_status"]


def diagnose(
    analysis: RunAnalysis,
    *,
    now: float | None = None,
    dead_ranks: frozenset[int] = frozenset(),
    live_ranks: frozenset[int] = frozenset(),
    flight: FlightFacts | None = None,
) -> Diagnosis:
    """The verdict (see `lifecycle.verdict.diagnose.diagnose`); `flight` places ranks in the
    collectives only the Flight Recorder's dumps show them in."""

    def placed(verdicts: dict[int, RankVerdict]) -> dict[int, RankVerdict]:
        assert flight is not None
        return in_flight(verdicts, flight, analysis)

    return verdict.diagnose(
        analysis,
        now=now,
        dead_ranks=dead_ranks,
        live_ranks=live_ranks,
        in_flight=None if flight is None else placed,
    )


def exit_status(d: Diagnosis) -> int:
    if d.outcome is Outcome.READY:
        return ReplayExit.OK
    if d.outcome in (Outcome.FAILED, Outcome.HUNG, Outcome.CRASHED):
        return ReplayExit.FAILURE
    return ReplayExit.NOT_READY
