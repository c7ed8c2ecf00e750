"""``taskdedup.django.effects()`` (this module is ``recorder``, as in taskdedup.sql): the
durable tier on Django's own connection.

The same contract as :func:`taskdedup.sql.effects` (SPEC §11), inside
``transaction.atomic()``: one ``INSERT … ON CONFLICT`` claims the identity (the statements
:mod:`taskdedup.sql.statements` sends, written here as raw SQL for Django's cursor, so no
SQLAlchemy is needed); a stored result adds one ``UPDATE`` of the row just inserted. A
concurrent run of the same identity waits on the primary key until the first commits (then it
is not first) or rolls back (then it is).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from django.db import connections

from ..effects_core import DEFAULT_TTL, Effects, identity, lifetime, warn_if_short
from ..exceptions import ConfigurationError, TaskDedupError

__all__ = ["DEFAULT_TTL", "Effects", "effects"]

SUPPORTED: Final = ("postgresql", "sqlite")

_UPSERT = (
    'INSERT INTO taskdedup_effects ("key", task_id, created, expires, result) '
    "VALUES ({key}, {task_id}, {now}, {expires}, NULL) "
    'ON CONFLICT ("key") DO UPDATE SET task_id = excluded.task_id, created = excluded.created, '
    "expires = excluded.expires, result = NULL "
    "WHERE taskdedup_effects.expires <= excluded.created "
    "RETURNING taskdedup_effects.task_id, taskdedup_effects.result"
)

CLAIM_POSTGRESQL: Final = (
    "WITH claimed AS ("
    + _UPSERT.format(key="%s", task_id="%s", now="%s::timestamptz", expires="%s::timestamptz")
    + ") SELECT true AS first, claimed.task_id, claimed.result FROM claimed "
    "UNION ALL SELECT false AS first, t.task_id, t.result FROM taskdedup_effects t "
    'WHERE t."key" = %s AND t.expires > %s::timestamptz AND NOT EXISTS (SELECT 1 FROM claimed)'
)
"""PostgreSQL: the claim and, when nothing was inserted, the live row, in one statement."""

CLAIM_SQLITE: Final = _UPSERT.format(key="%s", task_id="%s", now="%s", expires="%s")
"""SQLite: the claim answers the first run alone; a later run reads with :data:`READ`."""

READ: Final = 'SELECT task_id, result FROM taskdedup_effects WHERE "key" = %s AND expires > %s'
SET_RESULT: Final = {
    "postgresql": 'UPDATE taskdedup_effects SET result = %s::json WHERE "key" = %s',
    "sqlite": 'UPDATE taskdedup_effects SET result = %s WHERE "key" = %s',
}


def _stamp(vendor: str, moment: datetime) -> Any:
    """``moment`` as the column stores it: aware on PostgreSQL; on SQLite naive UTC text with
    microseconds, as SQLAlchemy's SQLite ``DateTime`` writes it (compared as text)."""
    if vendor == "sqlite":
        return moment.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
    return moment


def _decoded(vendor: str, value: Any) -> Any:
    """A ``result`` as read: SQLite returns the JSON text; psycopg decodes ``json`` itself (a
    stored string comes back as that string, not as JSON text)."""
    if vendor == "sqlite" and isinstance(value, str | bytes):
        return json.loads(value)
    return value


@contextmanager
def effects(
    *, key: str | None = None, ttl: float | timedelta | None = None, using: str = "default",
) -> Iterator[Effects]:
    """Record this run's identity in the current ``transaction.atomic()`` block of database
    ``using``; yield whether it is the first.

    Args:
        key: the identity; default the running task's (Celery or RQ: the key its message
            carried). Outside a task it is required.
        ttl: seconds (or timedelta) the row counts; default :data:`DEFAULT_TTL` (7 days).
            A row past its expiry is taken over by the next run. Shorter than the running
            task's redelivery delay, it warns once per task.
        using: the database alias (``DATABASES``), as ``transaction.atomic(using=...)``.

    Raises:
        ConfigurationError: no ``key`` outside a task; not inside ``transaction.atomic()``
            on ``using`` (the row would commit before the work, or never with it); a
            database other than PostgreSQL or SQLite; a bad ``ttl``.
    """
    key, now_running = identity(key, "taskdedup.django.effects()")
    seconds = lifetime(ttl)
    connection = connections[using]
    if not connection.in_atomic_block or connection.get_autocommit():
        raise ConfigurationError(
            f"taskdedup.django.effects() needs the task's own transaction: call it inside "
            f"`with transaction.atomic(using={using!r}):` (outside one, Django commits each "
            "statement on its own: the row would commit before the work, and a failed run's "
            "retry would skip it)"
        )
    vendor = connection.vendor
    if vendor not in SUPPORTED:
        raise ConfigurationError(
            f"taskdedup.django.effects() supports PostgreSQL (psycopg 3) and SQLite; database "
            f"{using!r} is {vendor!r}"
        )
    warn_if_short(now_running, seconds)
    task_id = now_running.task_id if now_running is not None else None
    moment = datetime.now(UTC)
    now = _stamp(vendor, moment)
    expires = _stamp(vendor, moment + timedelta(seconds=seconds))
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(CLAIM_POSTGRESQL, [key, task_id, now, expires, key, now])
            row = cursor.fetchone()
            first = row is not None and bool(row[0])
            stored = row[1:] if row is not None else None
        else:
            cursor.execute(CLAIM_SQLITE, [key, task_id, now, expires])
            row = cursor.fetchone()
            first, stored = row is not None, None
        if first:
            fx = Effects(key, True, task_id, None)
        else:
            if stored is None:  # SQLite; PostgreSQL after waiting on a row committed meanwhile
                cursor.execute(READ, [key, now])
                stored = cursor.fetchone()
                if stored is None:
                    raise TaskDedupError(
                        f"effects: {key} is held by a concurrent run whose row this "
                        "transaction cannot read (isolation above READ COMMITTED?); retry "
                        "the task"
                    )
            fx = Effects(key, False, stored[0], _decoded(vendor, stored[1]))
    yield fx
    result = fx.pending_result
    if result is not None:
        with connection.cursor() as cursor:
            cursor.execute(SET_RESULT[vendor], [json.dumps(result, allow_nan=False), key])
