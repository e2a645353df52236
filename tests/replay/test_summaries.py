"""The fast path and the full fold agree: each rank's view restored from its summary (plus the
events after its checkpoint) is the view folded from every event, and so is every verdict,
field by field. Checked on every journal of the fault matrix, on journals written through
the real writer from generated events, and on a journal upgraded from before summaries."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.core.format.checkpoint import checkpoint, restore
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.store import Journal, head_revision, journal_revision, to_url
from lifecycle.store.backends.revisions import alembic_config
from lifecycle.store.rows import RunRow
from tests.conftest import run_cli
from tests.replay.conftest import Journaled, copy_journal
from tests.replay.fastpath import verdicts_agree
from tests.strategies import events, rank_streams
from tests.support import T0


@pytest.mark.slow
def test_summaries_agree_on_real_startups(
    bounded_and_calibrated: Journaled, two_ranks: Journaled
) -> None:
    """Runs that ended healthy: `runs` judges them from their summaries, as the fold does."""
    assert verdicts_agree(bounded_and_calibrated.db) == 2
    assert verdicts_agree(two_ranks.db) == 1


@settings(max_examples=60, deadline=None)
@given(rank_streams(ranks=1))
def test_a_checkpoint_restores_the_fold_it_was_taken_of(stream: list[StoredEvent]) -> None:
    """Any events, folded, checkpointed and restored: the same view, and the same view after
    more events are applied to both."""
    fold = RankFold(run_id="run-a", rank=0)
    half = len(stream) // 2
    for stored in stream[:half]:
        fold.apply(stored)
    restored = restore(checkpoint(fold))
    assert restored.view() == fold.view()
    for stored in stream[half:]:
        fold.apply(stored)
        restored.apply(stored)
    assert restored.view() == fold.view()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(events(), min_size=1, max_size=5), min_size=1, max_size=30))
def test_the_writer_keeps_summaries_that_agree_with_its_events(
    tmp_path_factory: Any, batches: list[list[Any]]
) -> None:
    """Generated events appended in generated batches through the real writer: whatever was
    checkpointed when, the summary path reads the view the full fold reads."""
    db = tmp_path_factory.mktemp("gen") / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        journal.create_run(
            RunRow(run_id="gen", created_at=T0, host="h", world_size=2, config={},
                   lifecycle_version="t")
        )  # fmt: skip
        writers = [journal.writer(run_id="gen", rank=r) for r in (0, 1)]
        wall = T0
        for i, batch in enumerate(batches):
            wall += 0.5
            writers[i % 2].append_batch([(e, "created", wall, i) for e in batch])
        for writer in writers:
            writer.close()
    verdicts_agree(db)


def test_an_upgraded_journal_is_summarized_and_reads_the_same(
    two_ranks: Journaled, tmp_path: Path
) -> None:
    """A journal taken back to revision 0002 (no summaries) reads the same verdict through
    the full fold; `lifecycle db upgrade` summarizes its ranks, and the fast path agrees."""
    old = tmp_path / "old.db"
    copy_journal(two_ranks.db, old)
    command.downgrade(alembic_config(to_url(str(old))), "0002")
    before = run_cli("replay", ["diagnose", "latest", str(old), "--json"], cwd=tmp_path)
    result = run_cli("lifecycle", ["db", "upgrade", "--db", str(old)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{old}: at {head_revision()}; summarized 2 rank(s)"
    assert journal_revision(str(old)) == head_revision()
    with sqlite3.connect(old) as conn:
        assert conn.execute("SELECT count(*) FROM rank_checkpoints").fetchone() == (2,)
    verdicts_agree(old)
    after = run_cli("replay", ["diagnose", "latest", str(old), "--json"], cwd=tmp_path)
    assert after.stdout == before.stdout
    again = run_cli("lifecycle", ["db", "upgrade", "--db", str(old)], cwd=tmp_path)
    assert again.stdout.strip() == f"{old}: at {head_revision()}"


def test_runs_names_every_host_of_a_run(tmp_path: Path) -> None:
    """A run whose ranks ran on two hosts: `runs` names both, rank 0's first, from the
    summaries of a run that ended healthy and from the fold of one that did not."""
    from lifecycle.core.format.events import ActionFinished, RunStarted, Shutdown
    from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder

    for run_id, healthy in (("run-healthy", True), ("run-cut", False)):
        built = JournalBuilder(tmp_path / "j.db", run_id=run_id)
        for rank, host in ((0, "node-b"), (1, "node-a")):
            stream = built.rank(rank)
            stream.add(0.0, RunStarted(
                world_size=2, host=host, pid=1, lifecycle_version="t", torch_version="t",
                python_version="t", device="cpu", dist_backend="gloo",
            ))  # fmt: skip
            stream.walk(0.1, "gate-check", "bounded-warm", "ready")
            if healthy:
                stream.add(1.0, ActionFinished(action="ready", duration_s=0.1, ok=True))
                stream.add(1.1, Shutdown(reason="t", signal=None, events_written=5,
                                         journal_write_s=0.0))  # fmt: skip
        built.close()
    done = run_cli("replay", ["runs", str(tmp_path / "j.db"), "--json", *AS_WRITTEN], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    hosts = {row["run_id"]: (row["host"], row["outcome"]) for row in json.loads(done.stdout)}
    assert hosts["run-healthy"] == ("node-b,node-a", "ready")
    assert hosts["run-cut"][0] == "node-b,node-a" and hosts["run-cut"][1] != "ready"
