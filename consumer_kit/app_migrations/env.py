"""Alembic environment for an app's own revisions (``APP_MIGRATIONS``).

consumer-kit runs them on the connection it opened for its own migrations (``config.attributes
["connection"]``), right after those, with the app's version table (``APP_MIGRATIONS_TABLE``). There
is no model to compare with: a revision says what it changes with ``op.create_table`` and friends.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("these revisions run through `consumer-kit db upgrade` (it hands over the connection)")
context.configure(
    connection=connection,
    target_metadata=None,
    version_table=context.config.attributes.get("version_table", "alembic_version"),
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
