"""Run the Alembic migrations programmatically (tests, `higgs serve`, the migrate service)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

# migrations/ lives next to the app package at the repository root.
REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"


def alembic_config(url: str) -> Config:
    ini = REPO_ROOT / "alembic.ini"
    cfg = Config(str(ini)) if ini.exists() else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py reads this attribute first, so the URL never goes through ini interpolation.
    cfg.attributes["database_url"] = url
    return cfg


def upgrade_database(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (creates every table on a fresh database)."""
    command.upgrade(alembic_config(url), revision)


def downgrade_database(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
