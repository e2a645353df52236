"""Alembic migrations of the lifecycle journal (shipped as `lifecycle.migrations`)."""
