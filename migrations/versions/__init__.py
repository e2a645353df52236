"""Alembic revisions of the lifecycle journal."""
