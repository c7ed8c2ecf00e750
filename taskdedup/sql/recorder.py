"""``effects(conn)``: record this run's identity in the caller's transaction, once.

The hot path (the first run) is one statement; a stored result adds one ``UPDATE`` of the row
just inserted, in the same transaction. See :mod:`taskdedup.sql.statements` for what each
dialect sends and how a concurrent run of the same identity waits.

One function for both worlds: ``with effects(conn)`` on a sync ``Connection``/``Session`` and
``async with effects(conn)`` on an asyncio ``AsyncConnection``/``AsyncSession`` (SQLAlchemy's
own way: ``engine.begin()`` is ``with`` on an Engine and ``async with`` on an AsyncEngine). The
async form awaits the same single statement; the checks (AUTOCOMMIT refused, the identity,
the dialect) are shared.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ..effects_core import DEFAULT_TTL, Effects, identity, lifetime, warn_if_short
from ..exceptions import ConfigurationError, TaskDedupError
from .statements import READ, SET_RESULT, for_dialect

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["DEFAULT_TTL", "Claim", "Effects", "effects"]


def _connection(conn: Any) -> sa.Connection:
    """The Connection that ``conn`` (a Connection or a Session) runs its statements on."""
    if isinstance(conn, sa.Connection):
        return conn
    if isinstance(conn, Session):
        return conn.connection()
    if _is_async(conn):
        raise ConfigurationError(
            f"{type(conn).__name__} is asyncio SQLAlchemy: use the async form, "
            "`async with effects(conn) as fx:` / `await outbox.add(conn, ...)`"
        )
    raise ConfigurationError(
        "effects(conn) takes the SQLAlchemy Connection or ORM Session of the task's own "
        f"transaction (e.g. `with engine.begin() as conn`), not {type(conn).__name__}"
    )


def _is_async(conn: Any) -> bool:
    """Whether ``conn`` is one of SQLAlchemy's asyncio objects (without importing them)."""
    return type(conn).__module__.startswith("sqlalchemy.ext.asyncio")


async def _async_connection(conn: Any) -> sa.Connection:
    """The sync Connection behind ``conn`` (an ``AsyncConnection`` or ``AsyncSession``): what
    the checks read (its options and dialect; no statement is sent)."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    if isinstance(conn, AsyncConnection):
        return conn.sync_connection if conn.sync_connection is not None else (
            await conn.start()).sync_connection  # type: ignore[return-value]
    if isinstance(conn, (sa.Connection, Session)):
        raise ConfigurationError(
            f"`async with effects(conn)` takes an AsyncConnection or AsyncSession; this is a "
            f"sync {type(conn).__name__}: use `with effects(conn) as fx:`"
        )
    raise ConfigurationError(
        "`async with effects(conn)` takes the AsyncConnection or AsyncSession of the task's "
        f"own transaction (e.g. `async with engine.begin() as conn`), not {type(conn).__name__}"
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


class Claim:
    """What :func:`effects` returns: a context manager for a sync ``Connection``/``Session``
    (``with``) and for an asyncio ``AsyncConnection``/``AsyncSession`` (``async with``).

    Entering it sends the claim (one statement; ``await``-ed on an async connection) and
    yields the :class:`Effects`; leaving it without an error stores ``fx.result`` if the first
    run set one, in the same transaction.
    """

    __slots__ = ("_conn", "_fx", "_key", "_ttl")

    def __init__(self, conn: Any, key: str | None, ttl: float | timedelta | None) -> None:
        self._conn = conn
        self._key = key
        self._ttl = ttl
        self._fx: Effects | None = None

    # -- sync --------------------------------------------------------------------------------

    def __enter__(self) -> Effects:
        claim = _Prepared(self._key, self._ttl)
        claim.check(_connection(self._conn))
        row = self._conn.execute(claim.statements.claim, claim.params).first()
        if not claim.first(row) and row is None:
            row = self._conn.execute(READ, claim.read_params).first()
            self._fx = claim.earlier(row)
        else:
            self._fx = claim.answer(row)
        return self._fx

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        fx, self._fx = self._fx, None
        if exc_type is None and fx is not None and fx.pending_result is not None:
            self._conn.execute(SET_RESULT, {"b_key": fx.key, "b_result": fx.pending_result})

    # -- asyncio -----------------------------------------------------------------------------

    async def __aenter__(self) -> Effects:
        claim = _Prepared(self._key, self._ttl)
        claim.check(await _async_connection(self._conn))
        row = (await self._conn.execute(claim.statements.claim, claim.params)).first()
        if not claim.first(row) and row is None:
            row = (await self._conn.execute(READ, claim.read_params)).first()
            self._fx = claim.earlier(row)
        else:
            self._fx = claim.answer(row)
        return self._fx

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        fx, self._fx = self._fx, None
        if exc_type is None and fx is not None and fx.pending_result is not None:
            await self._conn.execute(SET_RESULT,
                                     {"b_key": fx.key, "b_result": fx.pending_result})


class _Prepared:
    """One claim, checked and ready to send: the identity, the statements of the dialect and
    their parameters (shared by the sync and the async form)."""

    __slots__ = ("key", "now", "now_running", "params", "seconds", "statements", "task_id")

    def __init__(self, key: str | None, ttl: float | timedelta | None) -> None:
        self.key, self.now_running = identity(key, "effects(conn)")
        self.seconds = lifetime(ttl)
        self.task_id = self.now_running.task_id if self.now_running is not None else None

    def check(self, connection: sa.Connection) -> None:
        """Refuse an AUTOCOMMIT connection or another dialect; build the parameters."""
        if _autocommit(connection):
            raise ConfigurationError(
                "effects(conn) needs the task's own transaction, but this connection is "
                "AUTOCOMMIT: the row would commit before the work, and a failed run's retry "
                "would skip it. Use `with engine.begin() as conn` on an engine without "
                "isolation_level='AUTOCOMMIT'"
            )
        self.statements = for_dialect(str(connection.dialect.name))
        warn_if_short(self.now_running, self.seconds)
        self.now = datetime.now(UTC)
        self.params = {"b_key": self.key, "b_task_id": self.task_id, "b_now": self.now,
                       "b_expires": self.now + timedelta(seconds=self.seconds)}

    @property
    def read_params(self) -> dict[str, Any]:
        return {"b_key": self.key, "b_now": self.now}

    def first(self, row: Any) -> bool:
        """Whether the claim's answer makes this run the first (SQLite: a row returned;
        PostgreSQL: its ``first`` column)."""
        return row is not None and (not self.statements.claim_reads or bool(row[0]))

    def answer(self, row: Any) -> Effects:
        """The claim's own answer: first, or (PostgreSQL) the stored row it read."""
        if self.first(row):
            return Effects(self.key, True, self.task_id, None)
        return self.earlier(row)

    def earlier(self, row: Any) -> Effects:
        """Not first: the stored row of the run that committed."""
        if row is None:
            raise TaskDedupError(
                f"effects: {self.key} is held by a concurrent run whose row this transaction "
                "cannot read (isolation above READ COMMITTED?); retry the task"
            )
        return Effects(self.key, False, row.task_id, row.result)


def effects(
    conn: sa.Connection | Session | AsyncConnection | AsyncSession, *, key: str | None = None,
    ttl: float | timedelta | None = None,
) -> Claim:
    """Record this run's identity in ``conn``'s transaction; yield whether it is the first.

    ``with effects(conn) as fx:`` on a sync ``Connection``/``Session``; ``async with
    effects(conn) as fx:`` on an asyncio ``AsyncConnection``/``AsyncSession`` (SQLAlchemy's
    ``create_async_engine``: PostgreSQL through ``postgresql+psycopg://``, SQLite through
    ``sqlite+aiosqlite://``). The same claim either way: one statement, ``await``-ed on an
    async connection.

    Args:
        conn: a SQLAlchemy 2 ``Connection`` or ORM ``Session`` (or their asyncio forms)
            inside the task's own transaction: the row commits with the task's writes or not
            at all.
        key: the identity; default the running task's (Celery or RQ: the key its message
            carried). Outside a task it is required.
        ttl: seconds (or timedelta) the row counts; default :data:`DEFAULT_TTL` (7 days,
            not the policy's Redis window: the row must outlive every redelivery). A row past
            its expiry is taken over by the next run. Shorter than the running task's
            redelivery delay, it warns once per task.

    Raises:
        ConfigurationError: (when the block is entered) no ``key`` outside a task; an
            unsupported connection or dialect; an async connection under ``with`` or a sync
            one under ``async with``; an ``AUTOCOMMIT`` connection (the row would commit
            before the work); a ``ttl`` that is not positive, finite and at most 100 years.
    """
    return Claim(conn, key, ttl)
