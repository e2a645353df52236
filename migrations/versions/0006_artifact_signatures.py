"""The compiler's artifacts signed by the operator's key.

An artifact runs code in the rank that loads it, so a startup loads one only when its signature
verifies: an HMAC-SHA256, of a key the operator holds, over the artifact's digest and its
compile key, stored with its row. Rows kept before this revision have none (NULL): they are not
loaded, and the next startup of their key keeps its own, signed, in their place.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 22:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("compile_artifacts") as batch:
        batch.add_column(sa.Column("signature", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("compile_artifacts") as batch:
        batch.drop_column("signature")
