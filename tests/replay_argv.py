"""Every replay command, as the arguments that run it on one journal."""

from __future__ import annotations

from pathlib import Path

REPLAY_COMMANDS = ("runs", "diagnose", "show", "verify", "trace", "diff")


def replay_argv(command: str, journal: Path, *, trace: Path) -> list[str]:
    """`replay COMMAND` on `journal`'s latest run (every run for verify); a trace goes to
    `trace`."""
    db = str(journal)
    return {
        "runs": ["runs", db],
        "diagnose": ["diagnose", "latest", db],
        "show": ["show", "latest", db],
        "verify": ["verify", "--all", db],
        "trace": ["trace", "latest", db, "-o", str(trace)],
        "diff": ["diff", "latest", "latest", db],
    }[command]
