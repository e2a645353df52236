"""The life of each host's weight keeper.

A keeper (`lifecycle keeper`) holds the finished weights of fingerprints for the ranks of its
host. It journals what happens to it here, one row each: started, holds (weights given to it),
handed (to a rank that attached), evicted, dropped (a rank rejected them), refused (over its
budget), lost (a keeper found that the one before it ended without stopping), stopped.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 01:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "keeper_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("keeper_pid", sa.Integer, nullable=False),
        sa.Column("wall", sa.Float, nullable=False),
        sa.Column("what", sa.String(32), nullable=False),
        sa.Column("key", sa.String(64), nullable=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
    )
    op.create_index("ix_keeper_log_host_wall", "keeper_log", ["host", "wall"])


def downgrade() -> None:
    op.drop_index("ix_keeper_log_host_wall", table_name="keeper_log")
    op.drop_table("keeper_log")
