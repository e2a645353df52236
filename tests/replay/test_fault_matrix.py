"""`replay diagnose` on real 2-rank journals with every fault kind in every state it applies to."""

from __future__ import annotations

import json
import re

import pytest

from lifecycle.core.settings.faults import FaultKind
from lifecycle.verdict.launched import exit_text
from replay.cli import main
from tests.replay.fastpath import verdicts_agree
from tests.replay.fault_matrix import CASES, Produced

# Every test that reads the matrix is in this file, so that pytest-xdist (--dist loadfile)
# makes it once, in one worker.
pytestmark = [pytest.mark.ranks]

# Exit statuses the launcher gives a rank it ended itself (SIGTERM journaled, or SIGKILL), and
# the status of a rank that failed and stopped on its own, as the launcher's summary shows them.
ENDED_BY_LAUNCHER = {exit_text(code) for code in (143, -15, -9, 1)}


def rank_exit(produced: Produced, rank: int) -> str | None:
    shown = r"exit -?\d+|killed by (?:SIG\w+|signal \d+)|stopped by SIG\w+ \(\d+\)"
    match = re.search(rf"^rank {rank}: .*?; ({shown})", produced.log, re.MULTILINE)
    return match.group(1) if match else None


def expected_outcome(produced: Produced, ranks: dict[int, dict]) -> str:  # type: ignore[type-arg]
    kind = produced.case.kind
    if kind is FaultKind.EXIT:
        return "crashed"
    if kind is FaultKind.HANG:
        return "hung"
    if kind is FaultKind.SKIP_COLLECTIVE:
        # Out of step, the two ranks may meet in collectives of different sizes; gloo then
        # aborts the process on one side (a crash), or the skipping rank finds that its next
        # staging buffer is not its peers' and fails (its peer aborted by that failure), or
        # both wait until the timeout (a hang).
        code = rank_exit(produced, 1)
        if code is not None and code not in ENDED_BY_LAUNCHER:
            return "crashed"
        own = ranks[1]["first_error"]
        if own is None or own["kind"] != "rank-disagreement":
            return "hung"
    # Rank 1 failed on its own, and the agreed abort stopped its peer: blocked if it had
    # waited for rank 1 in a collective for longer than a hang takes to show when rank 1
    # failed, else merely aborted (a raise its peer learned of at once is a failure).
    return "hung" if ranks[0]["status"] == "blocked" else "failed"


# The first of these makes the matrix (its 9 startups, 3 at a time) in its setup.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_diagnosis_names_the_faulty_rank_state_and_outcome(
    fault_matrix: dict[str, Produced], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 is the culprit, in the state the fault was injected in, with the outcome the
    fault produces; the peer is shown failed or blocked, its error of the kind the fault
    leads to, and the exit status is 1."""
    produced = fault_matrix[name]
    assert produced.returncode == 1, produced.log[-2000:]
    status = main(["diagnose", "latest", str(produced.db), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 1
    assert doc["culprit_ranks"] == [1], doc["summary"]
    assert doc["culprit_state"] == produced.case.state.value, doc["summary"]
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert doc["outcome"] == expected_outcome(produced, ranks), doc["summary"]
    assert ranks[0]["status"] in ("failed", "blocked", "aborted")
    if ranks[0]["status"] == "blocked":
        assert ranks[0]["pending_collective"]["waiting_for"] == [1]
    if produced.case.kind is FaultKind.HANG:
        assert ranks[0]["pending_collective"]["waiting_for"] == [1]
    if produced.case.kind is FaultKind.RAISE:
        assert doc["first_error"]["rank"] == 1
        assert doc["first_error"]["type"] == "InjectedFault"
        assert doc["first_error"]["kind"] == "injected-fault"
        assert ranks[1]["status"] == "failed"
    peer_error = ranks[0]["first_error"]
    if peer_error is not None and produced.case.kind in (FaultKind.EXIT, FaultKind.HANG):
        # The peer's collective broke on a closed connection, or ran out its time.
        gone = produced.case.kind is FaultKind.EXIT
        assert peer_error["kind"] == ("peer-gone" if gone else "collective-timeout")
    if produced.case.kind is FaultKind.HANG:
        assert ranks[1]["status"] == "hung"
    if produced.case.kind is FaultKind.EXIT:
        assert ranks[1]["status"] == "crashed"
    for key in ("run_id", "summary", "first_error"):
        assert key in doc
    for rank in doc["ranks"]:
        assert {"last_state", "status", "pending_collective", "last_heartbeat_age_s"} <= set(rank)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_the_boots_last_line_names_the_culprit_diagnose_names(
    fault_matrix: dict[str, Produced], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's last line leads with the rank `replay diagnose` names as the culprit, in
    the state it names, not with the first rank to fail (with a hang, that is its peer, whose
    collective timed out waiting for it)."""
    produced = fault_matrix[name]
    main(["diagnose", "latest", str(produced.db), "--json"])
    doc = json.loads(capsys.readouterr().out)
    (culprit,), state = doc["culprit_ranks"], doc["culprit_state"]
    last = [line for line in produced.log.splitlines() if line.startswith("boot: ")][-1]
    assert re.match(rf"boot: exit 1: rank {culprit} [a-z ]+ in {state}(:|;|$)", last), (
        last, doc["summary"],
    )  # fmt: skip


def test_summaries_agree_with_the_full_fold_on_the_fault_matrix(
    fault_matrix: dict[str, Produced],
) -> None:
    """Every fault kind in every state, 2 real ranks each: the same views and verdicts."""
    for produced in fault_matrix.values():
        verdicts_agree(produced.db)
