"""What a verdict needs, queryable without reading every event.

Collective records get their group, group sequence number and op as indexed columns, and each
run and rank gets a summary row that its writer keeps current in the transaction of every
append (its last sequence number, state, path, first fatal error), and a checkpoint of its
fold (the fold's state after `fold_seq`), so a reader folds only the events after it. Rows written before
this revision have NULL collective columns and no summary; readers compute what is missing
(`lifecycle db upgrade` fills it in).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("group_name", sa.String(64), nullable=True))
        batch.add_column(sa.Column("group_seq", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("op", sa.String(32), nullable=True))
    # Partial: only collective records are indexed, so other appends write no index page.
    op.create_index(
        op.f("ix_events_run_id_group_name_group_seq"),
        "events",
        ["run_id", "group_name", "group_seq"],
        sqlite_where=sa.text("group_name IS NOT NULL"),
        postgresql_where=sa.text("group_name IS NOT NULL"),
    )
    op.create_table(
        "rank_summaries",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.Integer(), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("first_wall", sa.Float(), nullable=True),
        sa.Column("last_wall", sa.Float(), nullable=True),
        sa.Column("last_heartbeat_wall", sa.Float(), nullable=True),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("first_error", sa.Text(), nullable=True),
        sa.Column("ready_at", sa.Float(), nullable=True),
        sa.Column("healthy", sa.Boolean(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.Column("planned", sa.Boolean(), nullable=False),
        sa.Column("calibrated", sa.Boolean(), nullable=False),
        sa.Column("skip_reason", sa.Text(), nullable=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_rank_summaries_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_rank_summaries")),
    )
    # The fold checkpoint apart from the counters: most appends update only the small row.
    op.create_table(
        "rank_checkpoints",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("fold_version", sa.Integer(), nullable=False),
        sa.Column("fold_seq", sa.Integer(), nullable=False),
        sa.Column("fold", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_rank_checkpoints_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_rank_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("rank_checkpoints")
    op.drop_table("rank_summaries")
    op.drop_index(op.f("ix_events_run_id_group_name_group_seq"), table_name="events")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("op")
        batch.drop_column("group_seq")
        batch.drop_column("group_name")
