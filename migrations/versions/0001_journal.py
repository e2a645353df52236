"""Create the journal: runs and events.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("lifecycle_version", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_table(
        "events",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("wall_time", sa.Float(), nullable=False),
        sa.Column("mono_ns", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_events_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "rank", "seq", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_run_id_kind"), "events", ["run_id", "kind"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_run_id_kind"), table_name="events")
    op.drop_table("events")
    op.drop_table("runs")
