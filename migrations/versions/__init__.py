"""Alembic revisions, one file each (Alembic skips this file)."""
