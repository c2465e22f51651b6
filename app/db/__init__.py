"""Database layer: typed SQLAlchemy 2.0 models, engine/session factory, migrations runner."""
