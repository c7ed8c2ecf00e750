"""``effects(conn)``: record this run's identity in the caller's transaction, once.

The hot path (the first run) is one statement; a stored result adds one ``UPDATE`` of the row
just inserted, in the same transaction. See :mod:`taskdedup.sql.statements` for what each
dialect sends and how a concurrent run of the same identity waits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .. import running
from ..exceptions import ConfigurationError, TaskDedupError
from ..policy import duration_seconds
from .statements import READ, SET_RESULT, for_dialect

__all__ = ["DEFAULT_TTL", "Effects", "effects"]

DEFAULT_TTL: Final = 7 * 24 * 3600.0
"""Seconds a row counts when ``ttl`` is not given: 7 days, in a task or outside one.

The row is the authority after the Redis window has gone: it must outlive every redelivery
of the task's message, whatever the policy's ``ttl`` (kombu's Redis transport hands an unacked
message out again after ``visibility_timeout``, an hour by default, and a broker outage or a
stopped worker can hold a message much longer), and a payment provider's retries of one
webhook (Stripe: up to 3 days). Rows past it are taken over, and removed by ``taskdedup sql
prune``."""

logger = logging.getLogger("taskdedup")

_WARNED: set[str] = set()
"""Tasks already warned about a row shorter than their redelivery delay (once per process)."""


class Effects:
    """What :func:`effects` yields.

    Attributes:
        key: the identity recorded.
        first: True when this run recorded it (do the work); False when an earlier run
            committed it and its row has not expired (do nothing, return :attr:`result`).
        task_id: the id of the run whose row it is (this run's when ``first``; None for a row
            recorded outside a task).
    """

    __slots__ = ("_result", "_result_set", "first", "key", "task_id")

    def __init__(self, key: str, first: bool, task_id: str | None, result: Any) -> None:
        self.key = key
        self.first = first
        self.task_id = task_id
        self._result = result
        self._result_set = False

    @property
    def result(self) -> Any:
        """The earlier run's stored result (``first`` False), or what this run set (JSON).

        Setting it on the first run stores it with the row when the block exits without an
        error, in the same transaction.
        """
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if not self.first:
            raise ConfigurationError(
                f"fx.result of {self.key} was stored by {self.task_id!r}, the first run; "
                "a later run reads it and cannot replace it"
            )
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:  # NaN or ±Infinity somewhere inside: not JSON, PostgreSQL refuses
            raise ValueError(
                f"fx.result of {self.key} must be strict JSON: NaN and Infinity are not JSON "
                "numbers (PostgreSQL would fail the whole transaction); store None or a "
                "string instead"
            ) from None
        except TypeError as exc:
            raise TypeError(f"fx.result must be JSON-serializable: {exc}") from None
        self._result = value
        self._result_set = True

    def __repr__(self) -> str:
        return f"Effects(key={self.key!r}, first={self.first}, task_id={self.task_id!r})"


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


def _warn_if_short(now_running: running.Running | None, seconds: float) -> None:
    """Warn once per task when its rows expire before its broker may redeliver it."""
    if now_running is None or now_running.redelivery is None:
        return
    if seconds >= now_running.redelivery or now_running.task in _WARNED:
        return
    _WARNED.add(now_running.task)
    logger.warning(
        "taskdedup: effects() rows of %s live %.0fs (ttl), less than the %.0fs its broker may "
        "take to redeliver its message (visibility_timeout + lease): a redelivery after the "
        "row expired would do the work again; give effects(ttl=...) at least %.0f, or leave "
        "the default (%.0fs)", now_running.task, seconds, now_running.redelivery,
        now_running.redelivery, DEFAULT_TTL,
    )


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
    now_running = running.current()
    if key is None:
        if now_running is None:
            raise ConfigurationError(
                "effects(conn) outside a gated Celery/RQ task needs key=...: no task is "
                "running in this context to take the identity from"
            )
        key = now_running.key
    seconds = DEFAULT_TTL if ttl is None else duration_seconds("effects(ttl=...)", ttl)
    connection = _connection(conn)
    if _autocommit(connection):
        raise ConfigurationError(
            "effects(conn) needs the task's own transaction, but this connection is "
            "AUTOCOMMIT: the row would commit before the work, and a failed run's retry would "
            "skip it. Use `with engine.begin() as conn` on an engine without "
            "isolation_level='AUTOCOMMIT'"
        )
    statements = for_dialect(str(connection.dialect.name))
    _warn_if_short(now_running, seconds)
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
    if fx.first and fx._result_set and fx._result is not None:
        conn.execute(SET_RESULT, {"b_key": key, "b_result": fx._result})
