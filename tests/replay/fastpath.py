"""The fast path held to the full fold: each rank's view restored from its summary (plus the
events after its checkpoint), and every verdict made from those views, against the same folded
from every event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay.history import history_rows
from replay.load import Journals
from replay.verdict.analysis import analyze, combine
from replay.verdict.diagnose import diagnose
from replay.views.diagnosis import diagnosis_json
from replay.views.runs import journaled_paths, summarize_run, summarize_settled
from tests.support import T0


def verdicts_agree(db: str | Path) -> int:
    """Compare both paths on every run of `db`; how many runs `replay runs` judged from
    their summaries alone (each of those too is held to the full fold)."""
    settled = 0
    with Journals.open([str(db)]) as journals:
        journals.prefetch_summaries()
        paths = journaled_paths(history_rows(journals, say_older=False))
        for run in journals.runs():
            full = analyze(run, journals.events(run))
            fast_views = journals.views(run)
            assert fast_views == full.views, run.run_id
            fast = combine(run, fast_views)
            assert fast == full
            assert _verdict(fast) == _verdict(full)
            ranks = journals.settled(run)
            if ranks is not None:
                settled += 1
                said = summarize_settled(run, ranks, journaled=paths.get(run.run_id))
                assert said == summarize_run(run, diagnose(full, now=T0 + 10_000))
    return settled


def _verdict(analysis: Any) -> dict[str, Any]:
    return diagnosis_json(diagnose(analysis, now=T0 + 10_000))
