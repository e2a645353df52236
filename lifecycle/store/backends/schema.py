"""The journal's tables as SQLAlchemy Core metadata (Alembic's `target_metadata`)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.schema import SchemaItem

# Every Alembic revision of the journal, oldest first; the last is head. Readers check a
# journal's revision against this without importing Alembic; a test keeps it equal to the
# scripts in migrations/versions.
KNOWN_REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005", "0006", "0007")

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

runs = Table(
    "runs",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("created_at", Float, nullable=False),  # seconds since the epoch
    Column("host", String(255), nullable=False),
    Column("world_size", Integer, nullable=False),
    Column("config", JSON, nullable=False),
    Column("lifecycle_version", String(32), nullable=False),
    Column("command", Text, nullable=True),  # the launch command line, to reproduce the run
)

events = Table(
    "events",
    metadata,
    Column("run_id", String(64), ForeignKey("runs.run_id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("seq", Integer, nullable=False),  # gapless from 0 per (run_id, rank)
    Column("wall_time", Float, nullable=False),  # seconds since the epoch
    Column("mono_ns", BigInteger, nullable=False),  # the writing process's monotonic clock
    Column("kind", String(64), nullable=False),
    Column("version", Integer, nullable=False),  # the payload schema version of `kind`
    Column("state", String(32), nullable=False),  # the rank's state after this event
    Column("data", JSON, nullable=False),  # the payload, a JSON object
    # A collective record's group, group sequence number and op (revision 0003; NULL for other
    # kinds and for rows written before it).
    Column("group_name", String(64), nullable=True),
    Column("group_seq", Integer, nullable=True),
    Column("op", String(32), nullable=True),
    # A second writer at the same (run_id, rank, seq) fails on this key instead of interleaving.
    PrimaryKeyConstraint("run_id", "rank", "seq"),
    Index(None, "run_id", "kind"),
    # Partial: only collective records are indexed, so other appends write no index page.
    Index(
        None,
        "run_id",
        "group_name",
        "group_seq",
        sqlite_where=text("group_name IS NOT NULL"),
        postgresql_where=text("group_name IS NOT NULL"),
    ),
)


def _per_rank(name: str, *columns: SchemaItem) -> Table:
    """A table of one row per run and rank: keyed by (run_id, rank), then `columns` (and any
    index on them)."""
    return Table(
        name,
        metadata,
        Column("run_id", String(64), ForeignKey("runs.run_id"), nullable=False),
        Column("rank", Integer, nullable=False),
        *columns,
        PrimaryKeyConstraint("run_id", "rank"),
    )


# One row per run and rank, kept current by the rank's writer in the transaction of every
# append (revision 0003): what a verdict needs without reading every event.
rank_summaries = _per_rank(
    "rank_summaries",
    Column("last_seq", Integer, nullable=False),
    Column("events", Integer, nullable=False),
    Column("state", String(32), nullable=False),
    Column("first_wall", Float, nullable=True),
    Column("last_wall", Float, nullable=True),
    Column("last_heartbeat_wall", Float, nullable=True),
    Column("path", Text, nullable=False),  # states entered, space-separated
    Column("first_error", Text, nullable=True),  # "error_kind: message" of the first fatal error
    # What `replay runs` says of a run every rank of which ended healthy, without its fold.
    Column("ready_at", Float, nullable=True),  # when it first entered ready
    Column("healthy", Boolean, nullable=False),  # its ready action finished (it served)
    Column("ended", Boolean, nullable=False),  # it journaled a shutdown, or stopped
    Column("planned", Boolean, nullable=False),  # it journaled a warmup plan
    Column("calibrated", Boolean, nullable=False),  # it went through probe
    Column("skip_reason", Text, nullable=True),  # its plan's calibration skip reason
    Column("host", String(255), nullable=True),  # the host its run_started names
)

# Each rank's fold after event `fold_seq` (format `fold_version`, JSON), rewritten by its writer
# with the events a verdict turns on (revision 0003); a reader folds only the events after it.
rank_checkpoints = _per_rank(
    "rank_checkpoints",
    Column("fold_version", Integer, nullable=False),
    Column("fold_seq", Integer, nullable=False),
    Column("fold", Text, nullable=False),
)

# Each healthy startup's time in each state before ready, one row per run and rank, written by
# the rank's writer with the append that finished its ready action (revision 0004). `key` is
# the history key the rank journaled at gate-check (its residency fingerprint and the path it
# took); a later startup reads the newest rows of its key through the index, never the events.
startup_history = _per_rank(
    "startup_history",
    Column("key", String(64), nullable=False),
    Column("ready_wall", Float, nullable=False),  # when the rank entered ready
    Column("process_ready_s", Float, nullable=True),  # its process's start to ready, if known
    Column("durations", Text, nullable=False),  # JSON: {state: seconds} for each state left
    Index(None, "key", "ready_wall"),
)

# The compiler's artifacts, one row per compile key (revision 0005): its parts, the artifact's
# digest and size, who stored it and who last used it, and (revision 0006) its signature, an
# HMAC-SHA256 of the operator's key over the digest and the key (NULL: not signed, never
# loaded). The bytes are in `data` on a server, and beside a SQLite journal in files named by
# their digest (`data` NULL).
compile_artifacts = Table(
    "compile_artifacts",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("model", String(255), nullable=False),
    Column("torch", String(64), nullable=False),
    Column("python", String(32), nullable=False),
    Column("machine", String(255), nullable=False),
    Column("backend", String(64), nullable=False),
    Column("mode", String(64), nullable=False),
    Column("digest", String(64), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("stored_run", String(64), nullable=False),
    Column("stored_at", Float, nullable=False),
    Column("used_run", String(64), nullable=True),
    Column("used_at", Float, nullable=True),
    Column("data", LargeBinary, nullable=True),
    Column("signature", String(64), nullable=True),
    Index(None, "model", "stored_at"),
)


# Each host's weight keeper, one row per thing that happened to it (revision 0007): started,
# holds, handed, evicted, dropped, refused, lost, stopped; with the weights key and bytes
# where one is concerned.
keeper_log = Table(
    "keeper_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("host", String(255), nullable=False),
    Column("keeper_pid", Integer, nullable=False),
    Column("wall", Float, nullable=False),
    Column("what", String(32), nullable=False),
    Column("key", String(64), nullable=True),
    Column("bytes", BigInteger, nullable=False),
    Column("detail", Text, nullable=True),
    Index(None, "host", "wall"),
)
