"""``outbox.add(conn, target, *args, **kwargs)``: a task call written into the caller's
transaction, published once the database has committed it (SPEC §14).

::

    from taskdedup.sql import outbox

    with engine.begin() as conn:
        conn.execute(orders.insert().values(ref="ORD-7", cents=5000))
        task_id = outbox.add(conn, charge.s("ORD-7", 5000))
    # committed: published now by this process; if it died first, by the relay

**When the publish happens.** SQLAlchemy's Core ``commit`` event fires *before* the database
commits, so nothing is published there: the rows of the transaction are only marked
"committing". They are published at the first point where the commit has surely succeeded:

* an ORM ``Session``: its ``after_commit`` event (right after the database commit);
* a Core ``Connection``: its return to the pool (``with engine.begin()`` /
  ``engine.connect()`` blocks: at the block's exit) or the start of its next transaction
  (commit-as-you-go: ``conn.commit()`` then the next statement), whichever comes first.

A commit the database refuses raises through SQLAlchemy's ``handle_error`` event first: its
rows are forgotten (they are not in the database). A rollback — explicit, by an exception, or
of a savepoint the rows were added in — forgets them too. After publishing, the published rows
are deleted with one ``DELETE ... WHERE id IN (...)`` on the same DBAPI connection (idle at
that point). A publish that fails leaves its row for the relay (WARNING, never raised: the
caller's transaction has committed).

The pieces are separate so that other front ends (async sessions) reuse them: :func:`envelope_of`
(pack), :func:`insert_row` (the INSERT), :func:`register` (the after-commit publish on a
sync ``Connection``, and on a ``Session``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, overload

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from ..exceptions import ConfigurationError
from ..outbox import Backlog, Envelope, Publisher, PublishError, Row, pack
from ..outbox.envelope import CELERY
from .recorder import _autocommit, _connection, _is_async
from .schema import OUTBOX
from .statements import for_dialect

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["SqlRows", "add", "backlog", "envelope_of", "insert_row", "register"]

logger = logging.getLogger("taskdedup")

_INFO_KEY: Final = "taskdedup_outbox"
_t = OUTBOX
_INSERT: Final = sa.insert(_t)


@dataclass(slots=True)
class _Call:
    """A row added in a transaction, with what publishes it from this process."""

    envelope: Envelope
    publisher: Publisher
    target: Any  # the producer's RQ queue (published on as is), else None


@dataclass(slots=True)
class _State:
    """The outbox rows of one DBAPI connection (kept in its ``info``, which follows it
    through the pool): added in the open transaction, or committing/committed."""

    dialect: Any
    pending: list[_Call] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)  # len(pending) at each open savepoint
    committed: list[_Call] = field(default_factory=list)


# -- add --------------------------------------------------------------------------------------


def envelope_of(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[
        Envelope, Publisher, Any]:
    """Pack a call, and what publishes it from the producer's process (its task's app, or
    its queue's connection and the queue itself)."""
    envelope = pack(target, *args, **kwargs)
    if envelope.kind == CELERY:  # a task's app, or a signature's
        return envelope, Publisher(celery_app=target.app), None
    return envelope, Publisher(rq_connection=target.connection), target


def insert_row(envelope: Envelope, now: datetime | None = None) -> tuple[sa.Executable,
                                                                          dict[str, Any]]:
    """The INSERT of ``envelope``'s row and its values (``next_attempt`` = ``created``)."""
    now = now or datetime.now(UTC)
    return _INSERT, {"id": envelope.id, "kind": envelope.kind, "target": envelope.target,
                     "body": envelope.body, "created": now, "next_attempt": now,
                     "attempts": 0, "last_error": None}


@overload
def add(conn: AsyncConnection | AsyncSession, target: Any, *args: Any,
        **kwargs: Any) -> Coroutine[Any, Any, str]: ...
@overload
def add(conn: sa.Connection | Session, target: Any, *args: Any, **kwargs: Any) -> str: ...
def add(conn: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
    """Write the call ``target(*args, **kwargs)`` into ``conn``'s transaction; it is
    published after the commit. Returns the id the task/job will run under. On asyncio
    SQLAlchemy (an ``AsyncConnection``/``AsyncSession``) it is awaited: ``await
    outbox.add(aconn, ...)`` (:mod:`taskdedup.sql.outbox_async`).

    Args:
        conn: a SQLAlchemy 2 ``Connection`` or ORM ``Session`` in the caller's transaction
            (an ``AUTOCOMMIT`` connection is refused: the row would be published before the
            caller's writes commit, or for writes that roll back).
        target: a Celery task or one task's signature (its options travel: queue, countdown,
            eta, priority, ``dedup_key``...; ``args``/``kwargs`` are appended as ``.delay``
            does) or an RQ ``DedupQueue`` (then ``args[0]`` is the function, as
            ``Queue.enqueue`` takes it). The task or queue needs a dedup policy.

    Raises:
        ConfigurationError: an AUTOCOMMIT connection, an unsupported dialect or connection, a
            target without a dedup policy, an argument its serializer refuses.
        TypeError: arguments without an identity.
    """
    if _is_async(conn):
        from .outbox_async import add as add_async

        return add_async(conn, target, *args, **kwargs)
    connection = _connection(conn)
    if _autocommit(connection):
        raise ConfigurationError(
            "outbox.add(conn, ...) needs the caller's transaction, but this connection is "
            "AUTOCOMMIT: the row would commit at once, whatever the caller's own writes do. "
            "Use `with engine.begin() as conn` (or a Session) on an engine without "
            "isolation_level='AUTOCOMMIT'"
        )
    for_dialect(str(connection.dialect.name))
    envelope, publisher, live = envelope_of(target, args, kwargs)
    statement, values = insert_row(envelope)
    connection.execute(statement, values)
    register(connection, _Call(envelope, publisher, live),
             conn if isinstance(conn, Session) else None)
    return envelope.id


# -- after the commit -------------------------------------------------------------------------


_watched_lock = threading.Lock()
_session_watched = False


def register(connection: sa.Connection, call: _Call, session: Session | None = None) -> None:
    """Publish ``call`` once ``connection``'s transaction has committed (see the module
    docstring); forget it if the transaction, or the savepoint it was added in, rolls back."""
    _watch(connection.engine, session is not None)
    info = connection.info
    state = info.get(_INFO_KEY)
    if state is None:
        state = info[_INFO_KEY] = _State(connection.dialect)
    state.pending.append(call)
    if session is not None:
        held = session.info.setdefault(_INFO_KEY, [])
        if all(s is not state for s, _ in held):
            held.append((state, connection.connection.dbapi_connection))


def _watch(engine: sa.Engine, session: bool) -> None:
    """Listen to ``engine``'s transactions (and Sessions' commits), once."""
    global _session_watched
    if session and not _session_watched:
        with _watched_lock:
            if not _session_watched:
                event.listen(Session, "after_commit", _on_session_commit)
                event.listen(Session, "after_transaction_end", _on_session_end)
                _session_watched = True
    if event.contains(engine, "commit", _on_commit):
        return
    with _watched_lock:
        if event.contains(engine, "commit", _on_commit):
            return
        event.listen(engine, "begin", _on_begin)
        event.listen(engine, "rollback", _on_rollback)
        event.listen(engine, "savepoint", _on_savepoint)
        event.listen(engine, "rollback_savepoint", _on_rollback_savepoint)
        event.listen(engine, "release_savepoint", _on_release_savepoint)
        event.listen(engine, "handle_error", _on_error)
        event.listen(engine, "checkin", _on_checkin)
        event.listen(engine, "commit", _on_commit)  # last: its presence means all are there


def _state(conn: sa.Connection) -> _State | None:
    try:
        state: _State | None = conn.info.get(_INFO_KEY)
    except Exception:  # an invalidated connection: nothing of ours can be on it
        return None
    return state


def _on_begin(conn: sa.Connection) -> None:
    """A new transaction: the previous one committed (or its rows were forgotten)."""
    state = _state(conn)
    if state is None:
        return
    state.pending.clear()  # a transaction that ended without our events: never published
    state.marks.clear()
    if state.committed:
        _flush(state, conn.connection.dbapi_connection)


def _on_commit(conn: sa.Connection) -> None:
    """The database is about to commit: the rows are committing, not published yet."""
    state = _state(conn)
    if state is not None and state.pending:
        state.committed.extend(state.pending)
        state.pending.clear()
        state.marks.clear()


def _on_rollback(conn: sa.Connection) -> None:
    state = _state(conn)
    if state is not None:
        state.pending.clear()
        state.marks.clear()


def _on_error(context: Any) -> None:
    """A statement or a commit failed: a commit that failed takes its rows with it (the next
    statement after a good commit starts a transaction first, which publishes them)."""
    conn = context.connection
    state = _state(conn) if conn is not None else None
    if state is not None and state.committed:
        logger.debug("taskdedup: the commit failed; its %d outbox row(s) are not published",
                     len(state.committed))
        state.committed.clear()


def _on_savepoint(conn: sa.Connection, name: str | None) -> None:
    state = _state(conn)
    if state is not None:
        state.marks.append(len(state.pending))


def _on_rollback_savepoint(conn: sa.Connection, name: str, context: Any) -> None:
    """Forget the rows added since the savepoint began. With no mark, the savepoint began
    before the first row of this transaction was added (before taskdedup listened): every
    pending row was added inside it."""
    state = _state(conn)
    if state is not None:
        mark = state.marks.pop() if state.marks else 0
        del state.pending[mark:]


def _on_release_savepoint(conn: sa.Connection, name: str, context: Any) -> None:
    state = _state(conn)
    if state is not None and state.marks:
        state.marks.pop()  # its rows now belong to the enclosing transaction


def _on_checkin(dbapi_connection: Any, record: Any) -> None:
    """The connection went back to the pool: its transaction is over."""
    state: _State | None = record.info.get(_INFO_KEY)
    if state is None:
        return
    state.pending.clear()
    state.marks.clear()
    if state.committed:
        _flush(state, dbapi_connection)


def _on_session_commit(session: Session) -> None:
    for state, dbapi_connection in session.info.pop(_INFO_KEY, ()):
        if state.committed:
            _flush(state, dbapi_connection)


def _on_session_end(session: Session, transaction: Any) -> None:
    """The session's transaction ended (after ``after_commit`` when it committed): what it
    registered is published or forgotten, never carried into the session's next transaction
    (whose DBAPI connection may be another)."""
    if transaction.parent is None:
        session.info.pop(_INFO_KEY, None)


def _flush(state: _State, dbapi_connection: Any) -> None:
    """Publish the committed rows (each through its gate), then delete the published ones
    in one statement on ``dbapi_connection`` (idle: outside any transaction of the caller's).
    A failure is logged and leaves the rows for the relay."""
    calls = list(state.committed)
    state.committed.clear()
    published: list[str] = []
    for call in calls:
        try:
            call.publisher.publish(call.envelope, call.target)
        except PublishError as exc:
            logger.warning("taskdedup: outbox row %s (%s %s) not published after its commit: "
                           "%s; the relay publishes it", call.envelope.id, call.envelope.kind,
                           call.envelope.target, exc.reason)
        else:
            published.append(call.envelope.id)
    if published and dbapi_connection is not None:
        try:
            _delete_raw(state.dialect, dbapi_connection, published)
        except Exception as exc:  # the relay publishes them again: harmless, same ids
            logger.warning("taskdedup: %d published outbox row(s) not deleted (%s: %s); the "
                           "relay will find them published", len(published),
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _delete_raw(dialect: Any, dbapi_connection: Any, ids: Sequence[str]) -> None:
    """``DELETE ... WHERE id IN (...)`` and COMMIT, on a DBAPI connection outside any
    SQLAlchemy transaction (the one that just committed the rows)."""
    compiled = sa.delete(_t).where(_t.c.id.in_(list(ids))).compile(
        dialect=dialect, compile_kwargs={"render_postcompile": True})
    params: Any = compiled.construct_params()
    if dialect.positional:
        params = tuple(params[name] for name in compiled.positiontup or ())
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(compiled.string, params)
    finally:
        cursor.close()
    dbapi_connection.commit()


# -- the relay's rows, and status --------------------------------------------------------------


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)  # SQLite keeps UTC, naive


class SqlRows:
    """The relay's :class:`~taskdedup.outbox.RowSource` on a SQLAlchemy engine.

    PostgreSQL: a batch is one transaction whose rows are taken ``FOR UPDATE SKIP LOCKED``,
    so several relays share the table and each row is published by one of them at a time.
    SQLite: each step is a short transaction of its own (a read transaction held while
    publishing would keep writers waiting); two relays there may publish one row twice, which
    runs once (the id is its identity).
    """

    def __init__(self, engine: sa.Engine) -> None:
        for_dialect(engine.dialect.name)
        self.engine = engine
        self.locks = engine.dialect.name == "postgresql"
        self._conn: sa.Connection | None = None

    def take(self, limit: int, grace_s: float) -> list[Row]:
        now = datetime.now(UTC)
        query = (sa.select(_t.c.id, _t.c.kind, _t.c.target, _t.c.body, _t.c.attempts)
                 .where(_t.c.created <= now - timedelta(seconds=grace_s),
                        _t.c.next_attempt <= now)
                 .order_by(_t.c.created).limit(limit))
        if self.locks:
            query = query.with_for_update(skip_locked=True)
            self._conn = self.engine.connect()
            try:
                rows = self._conn.execute(query).all()
            except BaseException:
                self._end(commit=False)
                raise
        else:
            with self.engine.connect() as conn:
                rows = conn.execute(query).all()
        return [Row(Envelope(r.id, r.kind, r.target, r.body), int(r.attempts)) for r in rows]

    def failed(self, id: str, error: str, next_attempt: datetime) -> None:
        update = sa.update(_t).where(_t.c.id == id).values(
            attempts=_t.c.attempts + 1, last_error=error, next_attempt=next_attempt)
        if self._conn is not None:
            self._conn.execute(update)
        else:
            with self.engine.begin() as conn:
                conn.execute(update)

    def done(self, ids: Sequence[str]) -> None:
        delete = sa.delete(_t).where(_t.c.id.in_(list(ids)))
        if self._conn is not None:
            try:
                if ids:
                    self._conn.execute(delete)
            finally:
                self._end(commit=True)
        elif ids:
            with self.engine.begin() as conn:
                conn.execute(delete)

    def _end(self, commit: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit:
                conn.commit()
        finally:
            conn.close()


def backlog(engine: sa.Engine) -> list[Backlog]:
    """The outbox's rows per target: how many, the oldest, the failing ones and the last
    error of the row tried most (two short reads)."""
    failing = sa.func.sum(sa.case((_t.c.attempts > 0, 1), else_=0))
    grouped = (sa.select(_t.c.kind, _t.c.target, sa.func.count().label("rows"),
                         sa.func.min(_t.c.created).label("oldest"), failing.label("failing"),
                         sa.func.max(_t.c.attempts).label("attempts"))
               .group_by(_t.c.kind, _t.c.target).order_by(_t.c.kind, _t.c.target))
    errors = (sa.select(_t.c.kind, _t.c.target, _t.c.last_error).where(_t.c.attempts > 0)
              .order_by(_t.c.attempts.desc(), _t.c.next_attempt.desc()).limit(10_000))
    with engine.connect() as conn:
        groups = conn.execute(grouped).all()
        last: dict[tuple[str, str], str | None] = {}
        if any(g.failing for g in groups):
            for kind, target, error in conn.execute(errors):
                last.setdefault((kind, target), error)
    return [Backlog(g.kind, g.target, int(g.rows), _aware(_as_datetime(g.oldest)),
                    int(g.failing or 0), int(g.attempts or 0), last.get((g.kind, g.target)))
            for g in groups]


def _as_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))  # SQLite's min() of a text column
