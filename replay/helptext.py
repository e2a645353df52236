"""What `replay --help` says: what RUN and JOURNAL may be, and each command's exit statuses.

The statuses here are replay/exits.py's table, which every command returns from; a test reads
them back from the help of each command.
"""

from __future__ import annotations

from lifecycle.core.command import DEFAULT_JOURNAL, JOURNAL_ENV

RUN_HELP = "a run id, a unique prefix of one, or 'latest'"
JOURNAL_HELP = (
    "a SQLite path or a SQLAlchemy URL; several are merged by run id"
    f" (default: ${JOURNAL_ENV}, else ./{DEFAULT_JOURNAL})"
)
RUN_TERM = """\
RUN      a run id, a unique prefix of one, or 'latest' (the run whose recorded start
         is the latest). An exact id wins over a prefix; a prefix of no run, or of
         several, is an error that says so."""
JOURNAL_TERM = f"""\
JOURNAL  a SQLite file path or a SQLAlchemy URL (sqlite:///PATH, postgresql://...),
         read and never written. Several are merged by run id: a file per rank, a
         node's and the fleet's. None given: ${JOURNAL_ENV}, else ./{DEFAULT_JOURNAL}, as
         `lifecycle boot` writes; replay never creates it."""
# Each command's exit statuses, one entry per status (continuation lines indented).
EXITS = {
    "replay": (
        "  0  done; diagnose: the run is ready; verify: every run replays consistently",
        "  1  diagnose: failed, hung or crashed; verify: a run disagrees with today's\n"
        "     gates, plan or transition table",
        "  3  diagnose: no failure found, but not ready (running, stopped, incomplete)",
    ),
    "diagnose": (
        "  0  ready: every rank reached ready",
        "  1  failed, hung or crashed",
        "  3  no failure found, but not ready: running (still starting), stopped (from\n"
        "     outside, before ready) or incomplete (the journals end before a verdict,\n"
        "     e.g. a rank's journal is missing)",
    ),
    "verify": (
        "  0  every run checked replays consistently",
        "  1  a run disagrees with today's gates, plan or transition table",
    ),
    "diff": ("  0  the two runs compared, whatever the verdict line says",),
    "history": ("  0  done, whatever the history holds (no run regressed or some did)",),
}
BAD_INPUT_EXIT = (
    "  2  bad input: a usage error, no usable journal, a RUN that names no run or\n"
    "     several, a trace output refused"
)
DIAGNOSE_HELP = "the verdict: outcome, culprit rank and state, first error, evidence"
HISTORY_HELP = (
    "per fingerprint and path, each startup state's median, p95 and count over the journal's"
    " healthy startups, their startup to ready, and the runs that regressed (a state or a"
    " startup over 1.5x the median of the runs before it); then each host's probe figures at"
    " gate-check, run by run"
)
HISTORY_NOTE = """\
The history is what each rank keeps when its startup reaches ready (revision 0004 on):
a startup learns its states' deadlines from the newest runs of its own fingerprint
(model, configuration, layout, device, versions, budget) and path (calibrated, reused,
bounded). Runs journaled before a journal's `lifecycle db upgrade` to 0004 have none.
The probe figures (the compute probe's time and speed, each group's all-to-all) are
each run's own, failed startups included, read from its `rank_probed` events."""


def epilog(name: str, *, run: bool = True) -> str:
    """What RUN and JOURNAL may be, and the command's exit statuses in order."""
    exits = sorted([*EXITS.get(name, ("  0  done",)), BAD_INPUT_EXIT])
    terms = [RUN_TERM, JOURNAL_TERM] if run else [JOURNAL_TERM]
    return "\n".join([*terms, "", "exit status:", *exits])
