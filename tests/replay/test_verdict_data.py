"""Verdicts are data: judged by recorded error kinds, never by class names or message text, and
holding facts from which the renderer makes the sentences."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    EnvironmentChecked,
    Error,
    RankProbed,
    RequestFinished,
    RunStarted,
    Shutdown,
    SlowRank,
    Stalled,
)
from lifecycle.core.format.kinds.rankevents import EnvironmentDifference, RankEnvironment
from lifecycle.testing.journals import (
    AS_WRITTEN,
    T0,
    JournalBuilder,
    a2a,
    append_raw,
    beat,
    done,
    timeout_error,
)
from lifecycle.verdict.evidence import Code
from replay.cli import main
from replay.load import Journals
from replay.verdict.analysis import analyze
from replay.verdict.diagnose import Diagnosis, diagnose
from tests.replay.scenarios import aborted_by_a_peer, hung_then_stopped, signalled, warming


def diagnosed(db: Path, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    main(["diagnose", "latest", str(db), "--json", *AS_WRITTEN])
    doc: dict = json.loads(capsys.readouterr().out)  # type: ignore[type-arg]
    return doc


def error(kind: str, message: str, error_type: str = "CollectiveError") -> Error:
    return Error(error_type=error_type, error_kind=kind, message=message, traceback="",
                 trigger=None, fatal=True)  # fmt: skip


def late_arrival(b: JournalBuilder, *, error_type: str, kind: str) -> None:
    """Rank 1 gives up on ulysses0 #4; rank 0 enters #4 only afterwards, then waits in #5."""
    warming(b)
    b.rank(1).add(1.0, a2a("ulysses0", 4))
    b.rank(1).add(3.0, timeout_error("ulysses0", 4, error_type=error_type, kind=kind))
    b.rank(0).add(3.5, a2a("ulysses0", 4))
    b.rank(0).add(3.6, done("ulysses0", 4))
    b.rank(0).add(3.7, a2a("ulysses0", 5))
    b.rank(0).add(5.7, timeout_error("ulysses0", 5, error_type=error_type, kind=kind))


def broken_under_rank_0(b: JournalBuilder, failure: Error | None) -> None:
    """Rank 0 waits in ulysses0 #0 for rank 1 until the collective fails (`failure`)."""
    warming(b)
    b.rank(0).add(1.0, a2a("ulysses0", 0))
    for at in (1.0, 1.5):
        b.rank(1).add(at, beat())
    if failure is not None:
        b.rank(0).add(1.5, failure)
        b.rank(0).walk(1.6, "failed")


@pytest.mark.parametrize("error_type", ["CollectiveTimeout", "DeadlineExceeded"])
def test_a_timeout_is_known_by_its_kind_whatever_its_class_is_called(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], error_type: str
) -> None:
    """A collective-timeout recorded under any class name makes the late rank the culprit."""
    b = JournalBuilder(tmp_path / "j.db")
    late_arrival(b, error_type=error_type, kind="collective-timeout")
    b.close()
    doc = diagnosed(tmp_path / "j.db", capsys)
    assert (doc["outcome"], doc["culprit_ranks"]) == ("hung", [0])
    assert "rank 0 came late to ulysses0 #4" in doc["summary"]
    assert {"code": "late-arrival", "rank": 0, "group": "ulysses0", "group_seq": 4,
            "entered_s": pytest.approx(3.5), "peer": 1,
            "peer_gave_up_s": pytest.approx(3.0)} in doc["evidence"]  # fmt: skip


def test_a_timeout_class_name_without_the_timeout_kind_is_no_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error named CollectiveTimeout but recorded as collective-failed is not read as a
    timeout: no rank came late, and the waits broke rather than timed out."""
    b = JournalBuilder(tmp_path / "j.db")
    late_arrival(b, error_type="CollectiveTimeout", kind="collective-failed")
    b.close()
    doc = diagnosed(tmp_path / "j.db", capsys)
    assert "came late" not in doc["summary"]
    assert not [e for e in doc["evidence"] if e["code"] == "late-arrival"]
    assert {e["ended"] for e in doc["evidence"] if e["code"] == "blocked"} == {"broke"}


@pytest.mark.parametrize(
    ("kind", "message", "status"),
    [
        ("peer-gone", "all_to_all #0 in group ulysses0 failed: link lost", "crashed"),
        ("collective-failed", "all_to_all #0 in group ulysses0 failed: Connection closed by"
         " peer [127.0.0.1]:29500", "hung"),
    ],
)  # fmt: skip
def test_a_peer_gone_is_known_by_its_kind_not_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, message: str, status: str
) -> None:
    """The peer a waiting rank lost is crashed when the error's kind is peer-gone, whatever
    the message says, and only then."""
    b = JournalBuilder(tmp_path / "j.db")
    broken_under_rank_0(b, error(kind, message))
    b.close()
    doc = diagnosed(tmp_path / "j.db", capsys)
    assert doc["culprit_ranks"] == [1]
    assert doc["ranks"][1]["status"] == status
    assert ({"code": "connection-broke", "rank": 1, "peer": 0} in doc["evidence"]) is (
        status == "crashed"
    )


def test_an_old_journal_is_judged_by_the_kind_its_upcaster_derives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A version 1 error row (no kind) whose message says the peer closed the connection
    reads as peer-gone: the peer is crashed, its note says why, and the first error's kind
    is in the JSON."""
    db = tmp_path / "j.db"
    b = JournalBuilder(db)
    broken_under_rank_0(b, None)
    b.close()
    v1 = {"error_type": "CollectiveError", "traceback": "", "trigger": None, "fatal": True,
          "message": "all_to_all #0 in group ulysses0 failed (ulysses-qkv): [pair.cc:534]"
                     " Connection closed by peer [127.0.0.1]:29500"}  # fmt: skip
    append_raw(db, rank=0, at=1.5, kind="error", version=1, state="bounded-warm",
               data=json.dumps(v1))  # fmt: skip
    append_raw(db, rank=0, at=1.6, kind="transition", version=1, state="failed",
               data='{"trigger": "fail", "source": "bounded-warm", "dest": "failed"}')  # fmt: skip
    doc = diagnosed(db, capsys)
    assert (doc["outcome"], doc["culprit_ranks"]) == ("crashed", [1])
    assert doc["first_error"]["kind"] == "peer-gone"
    assert doc["ranks"][1]["note"] == "its connection broke under rank 0"


# -- diagnoses hold no prose -------------------------------------------------------------------


def mismatched(b: JournalBuilder) -> None:
    warming(b)
    b.rank(0).add(1.0, a2a("ulysses0", 0, splits=(8, 8), out_splits=(8, 8)))
    b.rank(1).add(1.0, a2a("ulysses0", 0, splits=(8, 8), out_splits=(6, 8)))
    for rank in (0, 1):
        for t in range(2, 9):
            b.rank(rank).add(t, beat(a2a("ulysses0", 0)))


def cut_off_and_dead(b: JournalBuilder) -> None:
    """Rank 1's journal stops after ulysses0 #0 although rank 0 finished #1 with it."""
    b.rank(1).add(0.05, RunStarted(world_size=2, host="elsewhere", pid=4242,
                                   lifecycle_version="0.1.0", torch_version=None,
                                   python_version="3", device="cpu",
                                   dist_backend="gloo"))  # fmt: skip
    warming(b)
    for rank in (0, 1):
        b.rank(rank).add(1.0, a2a("ulysses0", 0))
        b.rank(rank).add(1.1, done("ulysses0", 0))
    b.rank(0).add(1.2, a2a("ulysses0", 1))
    b.rank(0).add(1.3, done("ulysses0", 1))
    for t in range(2, 9):
        b.rank(0).add(t, beat())


def stalled_alone(b: JournalBuilder) -> None:
    warming(b, (0,))
    b.rank(0).add(2.0, Stalled(in_state_s=400.0, deadline_s=300.0, pending=None, threads=()))
    for t in range(3, 6):
        b.rank(0).add(t, beat())


def shut_down_before_ready(b: JournalBuilder) -> None:
    for rank in (0, 1):
        b.rank(rank).walk(0.1, "gate-check")
        b.rank(rank).add(1.0, Shutdown(reason="operator asked", signal=None, events_written=3,
                                       journal_write_s=0.0))  # fmt: skip


def broken_by_the_stop(b: JournalBuilder) -> None:
    warming(b)
    for rank in (0, 1):
        b.rank(rank).add(1.0, a2a("ulysses0", 0))
    b.rank(0).add(1.2, signalled(9))
    b.rank(1).add(1.21, error("peer-gone", "all_to_all #0 in group ulysses0 failed: gone"))
    b.rank(1).walk(1.22, "failed")
    b.rank(1).add(1.5, signalled(9))


def one_rank_missing(b: JournalBuilder) -> None:
    b.rank(0).walk(0.1, "gate-check", "bounded-warm", "ready")
    b.rank(0).add(1.0, ActionStarted(action="mark-ready"))
    b.rank(0).add(1.1, ActionFinished(action="mark-ready", duration_s=0.1, ok=True))


def ended_at_its_timeout(b: JournalBuilder) -> None:
    """Rank 0's journal ends, with no error, as the timeout of the collective it waits in (and
    rank 1 never entered) runs out: NCCL's watchdog ending it."""
    warming(b)
    waiting = dataclasses.replace(a2a("world", 0), timeout_s=5.0)
    b.rank(0).add(1.0, waiting)
    for t in range(2, 12):
        if t <= 6:
            b.rank(0).add(t, beat(waiting))
        b.rank(1).add(t, beat())
    b.rank(1).add(12.0, signalled(12))


def checked_and_straggling(b: JournalBuilder) -> None:
    """At gate-check rank 1 runs another driver (a warning) and is slow (warned of); while
    serving it enters ulysses0's collectives late, request after request."""
    environment = RankEnvironment(
        host="gpu-a", torch="2.13.0", cuda="12.8", nccl="2.27.3", driver="570.1",
        python="3.11.7", device="NVIDIA H100", capability="9.0", memory_bytes=80 << 30,
        dtype="bfloat16",
    )  # fmt: skip
    differs = EnvironmentDifference(
        field="driver", matters=False, expected="570.1", expected_ranks=(0,), ranks=(1,),
        values=("570.2",),
    )  # fmt: skip
    for rank in (0, 1):
        stream = b.rank(rank)
        stream.walk(0.1, "gate-check")
        stream.add(0.5, EnvironmentChecked(environment=environment, differences=(differs,)))
        stream.add(0.6, RankProbed(host="gpu-a", device="NVIDIA H100", compute_s=0.003,
                                   compute_flop=1 << 37))  # fmt: skip
    slow = SlowRank(measure="compute", group="world", figure_s=0.012, median_s=0.003,
                    ratio=0.25, threshold=0.7, action="warn")  # fmt: skip
    b.rank(1).add(0.7, slow)
    for rank in (0, 1):
        b.rank(rank).walk(1.0, "bounded-warm", "ready")
        b.rank(rank).add(1.5, ActionStarted(action="mark-ready"))
        b.rank(rank).add(1.6, ActionFinished(action="mark-ready", duration_s=0.1, ok=True))
        for n in range(5):
            b.rank(rank).add(2.0 + n, RequestFinished(
                request_id=f"r{n}", ok=True, total_s=0.5, checksum="00", peak_bytes=1,
                lag_s=0.18 if rank == 1 else 0.0, lag_group="ulysses0",
            ))  # fmt: skip


SCENARIOS: dict[str, tuple[Callable[[JournalBuilder], None], int, frozenset[int]]] = {
    "late": (lambda b: late_arrival(b, error_type="CollectiveTimeout",
                                    kind="collective-timeout"), 2, frozenset()),
    "peer-gone": (lambda b: broken_under_rank_0(b, error("peer-gone", "gone")), 2, frozenset()),
    "hung-then-stopped": (hung_then_stopped, 2, frozenset()),
    "mismatch": (mismatched, 2, frozenset()),
    "cut-off": (cut_off_and_dead, 2, frozenset()),
    "dead": (cut_off_and_dead, 2, frozenset({1})),
    "stalled": (stalled_alone, 1, frozenset()),
    "shut-down": (shut_down_before_ready, 2, frozenset()),
    "broken-by-stop": (broken_by_the_stop, 2, frozenset()),
    "missing": (one_rank_missing, 2, frozenset()),
    "ended-at-timeout": (ended_at_its_timeout, 2, frozenset()),
    "aborted": (aborted_by_a_peer, 2, frozenset()),
    "checked-and-straggling": (checked_and_straggling, 2, frozenset()),
}  # fmt: skip

# A string that is a name (a code, a state, a group, an op, a signal), not a sentence.
NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def strings(value: object, path: str) -> Iterator[tuple[str, str]]:
    """Every string held in `value`, with where it is held."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from strings(item, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name != "analysis":  # the events as read, not the verdict
                yield from strings(getattr(value, f.name), f"{path}.{f.name}")


def judged(tmp_path: Path, name: str) -> tuple[Diagnosis, set[str]]:
    """The diagnosis of a scenario's journal, and every string its events hold."""
    build, world_size, dead = SCENARIOS[name]
    db = tmp_path / f"{name}.db"
    b = JournalBuilder(db, world_size=world_size)
    build(b)
    b.close()
    with Journals.open([str(db)]) as journals:
        run = journals.resolve("latest")
        events = list(journals.events(run))
    recorded = {text for stored in events for _, text in strings(stored.event, "")}
    return diagnose(analyze(run, iter(events)), now=T0, dead_ranks=dead), recorded


def test_diagnoses_hold_names_and_journal_text_only(tmp_path: Path) -> None:
    """Across verdicts that use every evidence code, each string a diagnosis holds is a name
    or text copied from the journal: the sentences are the renderer's alone."""
    codes = set()
    for name in SCENARIOS:
        diagnosis, recorded = judged(tmp_path, name)
        codes.update(item.code for item in diagnosis.evidence)
        for path, text in strings(diagnosis, name):
            assert NAME.fullmatch(text) or text in recorded, (path, text)
    assert codes == set(Code)
