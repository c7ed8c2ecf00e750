"""The durable tier's tables: ``taskdedup_effects`` (one row per identity whose effects were
committed) and ``taskdedup_outbox`` (calls committed but not yet published, SPEC §14)."""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

__all__ = ["OUTBOX", "OUTBOX_TABLE_NAME", "TABLE", "TABLE_NAME", "outbox_table", "table"]

TABLE_NAME: Final = "taskdedup_effects"
OUTBOX_TABLE_NAME: Final = "taskdedup_outbox"


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


def outbox_table(metadata: sa.MetaData) -> sa.Table:
    """The ``taskdedup_outbox`` table on ``metadata`` (for Alembic's autogenerate).

    Columns (the same in the Django app, so either reads the other's rows): ``id`` (the
    Celery task id / RQ job id, primary key), ``kind`` (``celery`` or ``rq``), ``target``
    (the task or queue name), ``body`` (the call, JSON: :class:`taskdedup.outbox.Envelope`),
    ``created``, ``next_attempt`` (indexed: the relay takes due rows by it), ``attempts``
    (failed publishes) and ``last_error``. Calling it twice on one ``metadata`` returns the
    same table.
    """
    existing = metadata.tables.get(OUTBOX_TABLE_NAME)
    if existing is not None:
        return existing
    return sa.Table(
        OUTBOX_TABLE_NAME,
        metadata,
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_attempt", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Index(f"ix_{OUTBOX_TABLE_NAME}_next_attempt", "next_attempt"),
    )


TABLE: Final = table(sa.MetaData())
"""The definition taskdedup itself uses (the same as :func:`table` gives)."""
OUTBOX: Final = outbox_table(TABLE.metadata)
"""The outbox's definition taskdedup itself uses, on the same metadata as :data:`TABLE`."""
