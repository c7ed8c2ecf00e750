"""The ``taskdedup_effects`` table: one row per identity whose effects were committed."""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

__all__ = ["TABLE", "TABLE_NAME", "table"]

TABLE_NAME: Final = "taskdedup_effects"


def table(metadata: sa.MetaData) -> sa.Table:
    """The ``taskdedup_effects`` table on ``metadata`` (for Alembic's autogenerate).

    Columns: ``key`` (the identity, primary key: the unique constraint that makes a second
    run wait and then see the first), ``task_id`` (the run that committed; NULL outside a
    task), ``created``, ``expires`` (indexed: ``taskdedup sql prune`` deletes by it) and
    ``result`` (JSON, what the first run stored). Calling it twice on one ``metadata`` returns
    the same table.
    """
    existing = metadata.tables.get(TABLE_NAME)
    if existing is not None:
        return existing
    return sa.Table(
        TABLE_NAME,
        metadata,
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("task_id", sa.Text, nullable=True),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires", sa.DateTime(timezone=True), nullable=False),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Index(f"ix_{TABLE_NAME}_expires", "expires"),
    )


TABLE: Final = table(sa.MetaData())
"""The definition taskdedup itself uses (the same as :func:`table` gives)."""
