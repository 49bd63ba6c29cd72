"""Alembic environment: runs on the connection ckptstore hands over, inside its transaction."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
context.run_migrations()
