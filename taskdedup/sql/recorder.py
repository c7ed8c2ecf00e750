"""``effects(conn)``: record this run's identity in the caller's transaction, once.

The hot path (the first run) is one statement; a stored result adds one ``UPDATE`` of the row
just inserted, in the same transaction. See :mod:`taskdedup.sql.statements` for what each
dialect sends and how a concurrent run of the same identity waits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .. import running
from ..exceptions import ConfigurationError, TaskDedupError
from .statements import READ, SET_RESULT, for_dialect

__all__ = ["DEFAULT_TTL", "Effects", "effects"]

DEFAULT_TTL: Final = 86_400.0
"""Seconds a row counts when ``key`` is given outside a task and ``ttl`` is not (24 hours,
as long as payment providers keep an idempotency key). Inside a task the default is the
policy's window."""


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
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"fx.result must be JSON-serializable: {exc}") from None
        self._result = value
        self._result_set = True

    def __repr__(self) -> str:
        return f"Effects(key={self.key!r}, first={self.first}, task_id={self.task_id!r})"


def _seconds(ttl: float | timedelta) -> float:
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
    if not seconds > 0:
        raise ConfigurationError(f"effects(ttl=...) must be positive seconds, got {ttl!r}")
    return seconds


def _dialect_name(conn: Any) -> str:
    if isinstance(conn, sa.Connection):
        return str(conn.dialect.name)
    if isinstance(conn, Session):
        return str(conn.get_bind().dialect.name)
    raise ConfigurationError(
        "effects(conn) takes the SQLAlchemy Connection or ORM Session of the task's own "
        f"transaction (e.g. `with engine.begin() as conn`), not {type(conn).__name__}"
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
        ttl: seconds (or timedelta) the row counts; default the running task's policy window,
            else :data:`DEFAULT_TTL`. A row past its expiry is taken over by the next run.

    Raises:
        ConfigurationError: no ``key`` outside a task; an unsupported connection or dialect.
    """
    now_running = running.current()
    if key is None:
        if now_running is None:
            raise ConfigurationError(
                "effects(conn) outside a gated Celery/RQ task needs key=...: no task is "
                "running in this context to take the identity from"
            )
        key = now_running.key
    if ttl is None:
        seconds = now_running.ttl if now_running is not None else DEFAULT_TTL
    else:
        seconds = _seconds(ttl)
    statements = for_dialect(_dialect_name(conn))
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
