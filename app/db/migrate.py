"""Run the Alembic migrations programmatically (tests, `higgs serve`, the migrate service)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

try:
    import migrations

    # The migrations package: the repository's migrations/ in a checkout, site-packages in an
    # image (production images install the project, not a source tree).
    MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
except ImportError:  # an editable install made before migrations/ was a package
    MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# alembic.ini (logging) sits beside migrations/ in a checkout; an installed service has none.
ALEMBIC_INI = MIGRATIONS_DIR.parent / "alembic.ini"


def alembic_config(url: str) -> Config:
    ini = ALEMBIC_INI
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
