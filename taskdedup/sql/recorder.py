"""``effects(conn)``: record this run's identity in the caller's transaction, once.

The hot path (the first run) is one statement; a stored result adds one ``UPDATE`` of the row
just inserted, in the same transaction. See :mod:`taskdedup.sql.statements` for what each
dialect sends and how a concurrent run of the same identity waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ..effects_core import DEFAULT_TTL, Effects, identity, lifetime, warn_if_short
from ..exceptions import ConfigurationError, TaskDedupError
from .statements import READ, SET_RESULT, for_dialect

__all__ = ["DEFAULT_TTL", "Effects", "effects"]


def _connection(conn: Any) -> sa.Connection:
    """The Connection that ``conn`` (a Connection or a Session) runs its statements on."""
    if isinstance(conn, sa.Connection):
        return conn
    if isinstance(conn, Session):
        return conn.connection()
    raise ConfigurationError(
        "effects(conn) takes the SQLAlchemy Connection or ORM Session of the task's own "
        f"transaction (e.g. `with engine.begin() as conn`), not {type(conn).__name__}"
    )


def _autocommit(conn: sa.Connection) -> bool:
    """True when ``conn`` commits each statement on its own: ``isolation_level="AUTOCOMMIT"``
    in its execution options, or given to ``create_engine`` (the dialect's on-connect level,
    which SQLAlchemy 2 keeps as ``_on_connect_isolation_level``)."""
    level = conn.get_execution_options().get("isolation_level")
    if level is None:
        dialect = conn.dialect
        level = getattr(dialect, "_on_connect_isolation_level", None) or getattr(
            dialect, "isolation_level", None)
    return level == "AUTOCOMMIT"


@contextmanager
def effects(
    conn: sa.Connection | Session, *, key: str | None = None,
    ttl: float | timedelta | None = None,
) -> Iterator[Effects]:
    """Record this run's identity in ``conn``'s transaction; yield whether it is the first.

    Args:
        conn: a SQLAlchemy 2 ``Connection`` or ORM ``Session`` inside the task's own
            transaction: the row commits with the task's writes or not at all.
        key: the identity; default the running task's (Celery or RQ: the key its message
            carried). Outside a task it is required.
        ttl: seconds (or timedelta) the row counts; default :data:`DEFAULT_TTL` (7 days,
            not the policy's Redis window: the row must outlive every redelivery). A row past
            its expiry is taken over by the next run. Shorter than the running task's
            redelivery delay, it warns once per task.

    Raises:
        ConfigurationError: no ``key`` outside a task; an unsupported connection or dialect;
            an ``AUTOCOMMIT`` connection (the row would commit before the work); a ``ttl``
            that is not positive, finite and at most 100 years.
    """
    key, now_running = identity(key, "effects(conn)")
    seconds = lifetime(ttl)
    connection = _connection(conn)
    if _autocommit(connection):
        raise ConfigurationError(
            "effects(conn) needs the task's own transaction, but this connection is "
            "AUTOCOMMIT: the row would commit before the work, and a failed run's retry would "
            "skip it. Use `with engine.begin() as conn` on an engine without "
            "isolation_level='AUTOCOMMIT'"
        )
    statements = for_dialect(str(connection.dialect.name))
    warn_if_short(now_running, seconds)
    task_id = now_running.task_id if now_running is not None else None
    now = datetime.now(UTC)
    params = {"b_key": key, "b_task_id": task_id, "b_now": now,
              "b_expires": now + timedelta(seconds=seconds)}
    row = conn.execute(statements.claim, params).first()
    if row is not None and (not statements.claim_reads or row[0]):  # PostgreSQL: "first"
        fx = Effects(key, True, task_id, None)
    else:
        if row is None:  # not first: the stored row (SQLite; PostgreSQL after a wait on it)
            row = conn.execute(READ, {"b_key": key, "b_now": now}).first()
            if row is None:
                raise TaskDedupError(
                    f"effects: {key} is held by a concurrent run whose row this transaction "
                    "cannot read (isolation above READ COMMITTED?); retry the task"
                )
        fx = Effects(key, False, row.task_id, row.result)
    yield fx
    result = fx.pending_result
    if result is not None:
        conn.execute(SET_RESULT, {"b_key": key, "b_result": result})
