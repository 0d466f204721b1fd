"""Alembic's entry point. `StateStore.migrate` runs it on its own connection; for a new
revision, `alembic -c connectors/state/migrations/alembic.ini -x url=sqlite:///state.db
revision --autogenerate -m "what changes"` compares `schema.metadata` with that database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from connectors.state.schema import metadata

connection = context.config.attributes.get("connection")
if connection is not None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(context.get_x_argument(as_dictionary=True)["url"])
    with engine.begin() as own_connection:
        context.configure(connection=own_connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
