"""The Alembic migrations (env.py, versions/): the only way the schema changes. A package, so
that an installed service (the production images install no source tree) finds them."""
