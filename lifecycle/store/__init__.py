"""The journal: a small store interface over SQLAlchemy, its backends, revisions and errors."""

from __future__ import annotations

from lifecycle.store.backends.revisions import (
    head_revision,
    journal_revision,
    known_revisions,
    migrations_dir,
    script_revisions,
)
from lifecycle.store.journal import Journal
from lifecycle.store.location import is_url, shown_location, to_url
from lifecycle.store.rows import RunRow
from lifecycle.store.writer import RankWriter

__all__ = [
    "Journal",
    "RankWriter",
    "RunRow",
    "head_revision",
    "is_url",
    "journal_revision",
    "known_revisions",
    "migrations_dir",
    "script_revisions",
    "shown_location",
    "to_url",
]
