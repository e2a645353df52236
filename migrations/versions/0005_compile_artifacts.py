"""The compiler's artifacts, kept with the journal for every pod of a fleet.

One row per compile key (the fingerprint, torch, Python, the machine and the compile options):
the key's parts, the artifact's digest (SHA-256) and size, the run that stored it and the run
that last used it. The bytes are in `data` on a database server (PostgreSQL), and beside a
SQLite journal in a folder of files named by their digest (`data` NULL), so that the journal's
file stays small. A startup reads one model's rows through the index on (model, stored_at).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "compile_artifacts",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("torch", sa.String(64), nullable=False),
        sa.Column("python", sa.String(32), nullable=False),
        sa.Column("machine", sa.String(255), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("mode", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_run", sa.String(64), nullable=False),
        sa.Column("stored_at", sa.Float(), nullable=False),
        sa.Column("used_run", sa.String(64), nullable=True),
        sa.Column("used_at", sa.Float(), nullable=True),
        sa.Column("data", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_compile_artifacts")),
    )
    op.create_index(
        op.f("ix_compile_artifacts_model_stored_at"), "compile_artifacts", ["model", "stored_at"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_compile_artifacts_model_stored_at"), table_name="compile_artifacts")
    op.drop_table("compile_artifacts")
