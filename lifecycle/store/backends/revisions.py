"""Schema revisions: the Alembic scripts, a journal's revision, and migrating it to head."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, inspect, text

from lifecycle.core.errors import JournalError, NotAJournal, SchemaMismatch
from lifecycle.store.backends.backend import backend_for
from lifecycle.store.backends.dberrors import DATABASE_ERRORS, journal_error
from lifecycle.store.backends.schema import KNOWN_REVISIONS

EMPTY = "empty"  # the revision of a database with no tables at all
REQUIRED_TABLES = frozenset({"runs", "events"})


def migrations_dir() -> Path:
    """The Alembic scripts: `migrations/` of a checkout, `lifecycle/migrations` when installed."""
    spec = importlib.util.find_spec("lifecycle.migrations")
    if spec is None or spec.origin is None:
        raise JournalError("the journal migrations are not installed with lifecycle")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def known_revisions() -> tuple[str, ...]:
    """Every revision this lifecycle knows, oldest first; the last is head."""
    return KNOWN_REVISIONS


def script_revisions() -> tuple[str, ...]:
    """The revisions of the Alembic scripts, oldest first (imports Alembic)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    heads = script.get_heads()
    if len(heads) != 1:
        raise JournalError(f"the journal migrations have {len(heads)} heads, expected one")
    return tuple(reversed([rev.revision for rev in script.walk_revisions()]))


def head_revision() -> str:
    return known_revisions()[-1]


def schema_revision(conn: Connection, location: str) -> str:
    """The journal's revision, or EMPTY for a database with no tables at all."""
    if conn.dialect.name == "sqlite":
        rows = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'")
        tables = {str(name) for (name,) in rows}
    else:
        tables = set(inspect(conn).get_table_names())
    if "alembic_version" not in tables:
        if not tables:
            return EMPTY
        listed = ", ".join(sorted(tables)[:5])
        raise NotAJournal(location=location, reason=f"a database of another program ({listed})")
    versions = [
        str(v) for v in conn.execute(text("SELECT version_num FROM alembic_version")).scalars()
    ]
    if len(versions) != 1:
        raise NotAJournal(location=location, reason=f"{len(versions)} schema revisions recorded")
    revision = versions[0]
    if revision not in known_revisions():
        raise SchemaMismatch(
            location=location,
            found=revision,
            expected=head_revision(),
            hint="unknown to this lifecycle: written by a newer lifecycle or another program;"
            " upgrade lifecycle to read it",
        )
    if revision == head_revision() and not tables >= REQUIRED_TABLES:
        raise NotAJournal(location=location, reason="journal tables are missing")
    return revision


def read_revision(engine: Engine, location: str) -> str:
    """The revision of the journal behind `engine`, read through one short connection."""
    try:
        with engine.connect() as conn:
            return schema_revision(conn, location)
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, location) from None


def check_head(revision: str, location: str) -> None:
    """Refuse an older journal of ours: it is upgraded only when asked to."""
    if revision not in (head_revision(), EMPTY):
        raise SchemaMismatch(
            location=location,
            found=revision,
            expected=head_revision(),
            hint=f"older: run `lifecycle db upgrade --db {location}`",
        )


def migrate(engine: Engine, location: str, url: str, *, upgrade: bool) -> None:
    """Bring a new, empty or (with `upgrade`) older journal to head, checking its revision
    again on the connection that migrates, in one transaction."""
    from alembic import command

    try:
        with engine.connect() as conn:
            revision = schema_revision(conn, location)
            if revision == head_revision():
                conn.rollback()
                return
            if revision != EMPTY and not upgrade:
                check_head(revision, location)
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
            conn.commit()
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, location, writing=True) from None


def journal_revision(location: str) -> str:
    """The schema revision of an existing journal, read without writing to it."""
    backend = backend_for(location)
    if not backend.has_data():
        return EMPTY
    engine = backend.read_engine()
    try:
        return read_revision(engine, backend.location)
    finally:
        engine.dispose()
