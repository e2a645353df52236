"""`replay history`'s gate figures: each host's probe figures at gate-check run by run (the
fixed matmul's best time and speed, each group's all-to-all), so that a host whose device or
links slow down over weeks shows it. `gate_figures` reads them, `format_gate_figures` and
`gate_figures_json` say them."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.events import RankProbed
from lifecycle.core.format.kinds.rankevents import LinkFigure
from lifecycle.core.format.text import clean
from replay.load import Journals, RunInfo
from replay.verdict.rankchecks import duration_text, gflops, size_text, speed_text
from replay.views.render import Style, table, when

# The newest runs of a host the text shows (the JSON gives every one).
RUNS_SHOWN = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFigures:
    """One rank's probe figures in one run."""

    rank: int
    device: str
    compute_s: float
    compute_flop: int
    links: tuple[LinkFigure, ...]

    @property
    def gflops(self) -> float | None:
        return gflops(self.compute_flop, self.compute_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRun:
    """A run's figures on one host: those of its ranks there."""

    run_id: str
    created_at: float
    ranks: tuple[RankFigures, ...]

    @property
    def gflops(self) -> float | None:
        """The median speed of its ranks on the host whose figures are times."""
        speeds = [s for r in self.ranks if (s := r.gflops) is not None]
        return statistics.median(speeds) if speeds else None


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFigures:
    """One host's runs that journaled probe figures, oldest first."""

    host: str
    runs: tuple[HostRun, ...]

    def trend(self) -> tuple[float, float, int] | None:
        """The newest run's speed, the median of the runs' before it and how many they are;
        None before a second run."""
        speeds = [s for run in self.runs if (s := run.gflops) is not None]
        if len(speeds) < 2:
            return None
        return speeds[-1], statistics.median(speeds[:-1]), len(speeds) - 1


def gate_figures(journals: Journals, runs: Sequence[RunInfo]) -> list[HostFigures]:
    """The probe figures of every run given, by host; a rank in several journals read from
    the first; what cannot be read is one of `journals.problems`."""
    from lifecycle.core.errors import JournalError
    from lifecycle.store.learned.history import probes_of

    found: dict[tuple[str, int], RankProbed] = {}
    for journal in journals.sources:
        run_ids = [run.run_id for run in runs if journal.location in run.sources]
        if not run_ids:
            continue
        try:
            probes, problems = probes_of(journal.engine, journal.location, run_ids)
        except JournalError as exc:
            journals.problems.append(str(exc))
            continue
        journals.problems.extend(p for p in problems if p not in journals.problems)
        for stored in probes:
            assert isinstance(stored.event, RankProbed)
            found.setdefault((stored.run_id, stored.rank), stored.event)
    return _by_host(runs, found.items())


def _by_host(
    runs: Sequence[RunInfo], probes: Iterable[tuple[tuple[str, int], RankProbed]]
) -> list[HostFigures]:
    per_host: dict[str, dict[str, list[RankFigures]]] = {}
    for (run_id, rank), probed in probes:
        figures = RankFigures(
            rank=rank,
            device=probed.device,
            compute_s=probed.compute_s,
            compute_flop=probed.compute_flop,
            links=probed.links,
        )
        per_host.setdefault(probed.host, {}).setdefault(run_id, []).append(figures)
    created = {run.run_id: run.created_at for run in runs}
    order = {run.run_id: index for index, run in enumerate(runs)}
    return [
        HostFigures(
            host=host,
            runs=tuple(
                HostRun(
                    run_id=run_id,
                    created_at=created[run_id],
                    ranks=tuple(sorted(ranks, key=lambda r: r.rank)),
                )
                for run_id, ranks in sorted(by_run.items(), key=lambda kv: order[kv[0]])
            ),
        )
        for host, by_run in sorted(per_host.items())
    ]


def _links_cell(links: Sequence[LinkFigure]) -> str:
    """'ulysses0 4.42 ms (57 MiB/s), cfg0 ...'."""
    return (
        ", ".join(
            f"{link.group} {duration_text(link.seconds)} ({size_text(link.bytes / link.seconds)}/s)"
            if link.seconds > 0
            else f"{link.group} not a time"
            for link in links
        )
        or "-"
    )


def _trend_line(h: HostFigures) -> str | None:
    trend = h.trend()
    if trend is None or not trend[1] > 0:  # a hand-written journal's probe of no work
        return None
    newest, before, count = trend
    return (
        f"  newest run: compute {newest / before:.2f}x the median speed of the {count} run(s)"
        f" before it ({newest:.1f} against {before:.1f} GFLOP/s, each run's median rank)"
    )


def format_gate_figures(found: Sequence[HostFigures], style: Style) -> str:
    """Each host's table of its newest runs' probe figures, rank by rank, and its trend."""
    blocks = ["gate-check probes per host (each the best of its repetitions), oldest run first:"]
    for h in found:
        shown = h.runs[-RUNS_SHOWN:]
        rows = [
            [
                run.run_id if i == 0 else "",
                when(run.created_at) if i == 0 else "",
                r.rank,
                f"{duration_text(r.compute_s)} ({speed_text(r.compute_flop, r.compute_s)})",
                _links_cell(r.links),
            ]
            for run in shown
            for i, r in enumerate(run.ranks)
        ]
        lines = [f"{style.bold(clean(h.host))}  {len(h.runs)} run(s)"]
        if len(h.runs) > len(shown):
            lines.append(
                f"  the newest {len(shown)}; {len(h.runs) - len(shown)} older run(s) in --json"
            )
        lines.extend(
            "  " + line
            for line in table(["run", "when", "rank", "compute", "links"], rows).splitlines()
        )
        if (trend := _trend_line(h)) is not None:
            lines.append(trend)
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def gate_figures_json(found: Sequence[HostFigures]) -> list[dict[str, Any]]:
    return [
        {
            "host": h.host,
            "runs": [
                {
                    "run_id": run.run_id,
                    "created_at": run.created_at,
                    "gflops": run.gflops,
                    "ranks": [
                        {
                            "rank": r.rank,
                            "device": r.device,
                            "compute_s": r.compute_s,
                            "compute_flop": r.compute_flop,
                            "gflops": r.gflops,
                            "links": [
                                {"group": link.group, "seconds": link.seconds, "bytes": link.bytes}
                                for link in r.links
                            ],
                        }
                        for r in run.ranks
                    ],
                }
                for run in h.runs
            ],
        }
        for h in found
    ]
