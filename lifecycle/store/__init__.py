"""The journal: a small store interface over SQLAlchemy, its backends, revisions and errors."""
