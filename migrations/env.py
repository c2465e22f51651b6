"""Alembic environment. The database URL comes from, in order: the config attribute
"database_url" (programmatic use, app.db.migrate), `-x url=...` on the command line, then the
service Settings (HIGGS_DATABASE_URL or the default SQLite file under HIGGS_DATA_DIR)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from app.db import models  # noqa: F401  (registers the tables on Base.metadata)
from app.db.base import Base
from app.db.session import create_db_engine, normalise_url

config = context.config


def _database_url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    x = context.get_x_argument(as_dictionary=True)
    if x.get("url"):
        return x["url"]
    from app.settings import Settings

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings.database_url


if config.config_file_name is not None and "database_url" not in config.attributes:
    # Only the alembic command line configures logging; programmatic callers keep theirs.
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=normalise_url(_database_url()),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_db_engine(_database_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
