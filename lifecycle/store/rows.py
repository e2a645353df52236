"""A run's row as the journal keeps it, without the secrets a command line may carry."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from lifecycle.store.location import command_without_passwords, without_password


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRow:
    run_id: str
    created_at: float
    host: str
    world_size: int
    config: dict[str, Any]
    lifecycle_version: str
    command: str | None = None  # None in journals older than revision 0002


def without_secrets(row: RunRow) -> RunRow:
    """The run row with every URL password hidden: in the journal's location (`config["db"]`)
    and in the command line."""
    config = row.config
    db = config.get("db")
    if isinstance(db, str) and without_password(db) != db:
        config = {**config, "db": without_password(db)}
    command = None if row.command is None else command_without_passwords(row.command)
    if config is row.config and command == row.command:
        return row
    return replace(row, config=config, command=command)


def is_int(value: object) -> bool:
    """An integer as a row holds it (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Undecodable:
    """What a JSON column holds when it does not decode (see `json_column`)."""


UNDECODABLE = Undecodable()


def json_column(text: object) -> object:
    """A JSON column's value decoded; UNDECODABLE for text that is not JSON, nests deeper than
    the parser recurses, or is not text. A damaged row is left out by its reader, never raised
    from: a journal is read for what it can still say."""
    if not isinstance(text, str):
        return text if isinstance(text, dict | list) else UNDECODABLE
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return UNDECODABLE
