"""Each healthy startup's state durations, per rank, keyed by what the durations depend on.

A rank whose startup reached ready (its ready action done) writes one row in the transaction of
that append: the history key it journaled at gate-check (the residency fingerprint and the
path taken), when it entered ready, how long after its process started, and how long it spent
in each state before ready. A later startup reads the newest rows of its key through the
index on (key, ready_wall), never the events, to learn when a state has stalled; `replay
history` reads every row. Runs written before this revision have no row.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "startup_history",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("ready_wall", sa.Float(), nullable=False),
        sa.Column("process_ready_s", sa.Float(), nullable=True),
        sa.Column("durations", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_startup_history_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_startup_history")),
    )
    op.create_index(
        op.f("ix_startup_history_key_ready_wall"), "startup_history", ["key", "ready_wall"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_startup_history_key_ready_wall"), table_name="startup_history")
    op.drop_table("startup_history")
