"""The tables, as Django models: the same tables the SQLAlchemy tier creates, so either can
read the other's rows.

The migration (``migrations/0001_initial.py``) writes their DDL itself on PostgreSQL and
SQLite, column for column as :func:`taskdedup.sql.table` and the outbox's table, and only
if the tables are not there yet (a database that ``taskdedup sql init`` prepared keeps its
tables).
"""

from __future__ import annotations

import json
from typing import Any

from django.db import models

__all__ = ["Effect", "JSONColumn", "OutboxRow"]


class JSONColumn(models.JSONField):  # type: ignore[misc]
    """A JSON column that is ``json`` on PostgreSQL, as SQLAlchemy's ``JSON`` makes it (Django's
    own ``JSONField`` is ``jsonb``); psycopg hands its values over already decoded."""

    def db_type(self, connection: Any) -> str | None:
        if connection.vendor == "postgresql":
            return "json"
        return super().db_type(connection)  # type: ignore[no-any-return]

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        return super().from_db_value(value, expression, connection)

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        if connection.vendor == "postgresql" and value is not None:
            return json.dumps(value, allow_nan=False)  # text, cast to json by the column
        return super().get_db_prep_value(value, connection, prepared)


class Effect(models.Model):  # type: ignore[misc]
    """One identity whose effects were committed (``taskdedup.django.effects``)."""

    key = models.TextField(primary_key=True, db_column="key")
    task_id = models.TextField(null=True, help_text="The run that committed (NULL outside a task).")
    created = models.DateTimeField()
    expires = models.DateTimeField(help_text="Past it, the next run takes the row over.")
    result = JSONColumn(null=True, help_text="What the first run stored (fx.result).")

    class Meta:
        db_table = "taskdedup_effects"
        managed = True
        ordering = ("-created",)
        indexes = [models.Index(fields=["expires"], name="ix_taskdedup_effects_expires")]
        verbose_name = "effect"

    def __str__(self) -> str:
        return str(self.key)


class OutboxRow(models.Model):  # type: ignore[misc]
    """A call committed but not yet published (``taskdedup.django.outbox.add``)."""

    id = models.TextField(primary_key=True, help_text="The Celery task id / RQ job id.")
    kind = models.CharField(max_length=16, help_text='"celery" or "rq".')
    target = models.CharField(max_length=255, help_text="The Celery task name or RQ queue.")
    body = models.TextField(help_text="The envelope (JSON).")
    created = models.DateTimeField()
    next_attempt = models.DateTimeField()
    attempts = models.IntegerField(default=0)
    last_error = models.TextField(null=True)

    class Meta:
        db_table = "taskdedup_outbox"
        managed = True
        ordering = ("created",)
        verbose_name = "outbox row"
        # ix_taskdedup_outbox_next_attempt (on next_attempt) is created by the migration:
        # its name, the SQLAlchemy tier's, is longer than Django's 30-character limit.

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}:{self.id}"
