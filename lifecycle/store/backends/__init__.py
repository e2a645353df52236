"""The databases a journal lives in: the store interface, SQLite, PostgreSQL, any
SQLAlchemy URL, their schema, revisions and errors."""
