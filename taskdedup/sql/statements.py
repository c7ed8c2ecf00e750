"""The statements of the durable tier, one set per supported dialect, built once.

The claim is one statement: insert the identity's row, or take over a row past its expiry
(``ON CONFLICT (key) DO UPDATE ... WHERE expires <= now``), and return whether this run is
the first. A row that is still live is left as it is but locked by the conflict, so a
concurrent run of the same identity waits on the unique index until the first commits (then
it is not first) or rolls back (then it is).

* PostgreSQL: the insert is a data-modifying CTE, and the same statement reads the live row
  when nothing was inserted (``first`` false, the stored ``task_id`` and ``result``): one round
  trip in every case but one. When the live row was committed by a concurrent run *while* this
  statement waited for it, the statement's snapshot predates it and the read finds nothing;
  only then a second statement (:data:`READ`, with a fresh snapshot) reads it.
* SQLite has no data-modifying CTEs: ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING``
  answers the first run alone, and a run that is not first reads the stored row with
  :data:`READ`, in process (no network round trip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from ..exceptions import ConfigurationError
from .schema import TABLE

__all__ = ["READ", "SET_RESULT", "SUPPORTED", "Statements", "for_dialect"]

SUPPORTED: Final = ("postgresql", "sqlite")

_t = TABLE
_key = sa.bindparam("b_key", type_=sa.Text)
_now = sa.bindparam("b_now", type_=_t.c.created.type)

READ: Final = sa.select(_t.c.task_id, _t.c.result).where(_t.c.key == _key, _t.c.expires > _now)
"""The live row of an identity (a run that is not first reads what the first stored)."""

SET_RESULT: Final = sa.update(_t).where(_t.c.key == _key).values(
    result=sa.bindparam("b_result", type_=_t.c.result.type)
)
"""Store the first run's result in its own row, in its transaction."""


@dataclass(frozen=True, slots=True)
class Statements:
    """The claim of one dialect; ``claim_reads`` tells whether a not-first claim already
    returns the stored row (PostgreSQL) or :data:`READ` must follow (SQLite)."""

    claim: sa.Executable
    claim_reads: bool


def _upsert(insert: postgresql.Insert | sqlite.Insert) -> sa.Executable:
    stmt = insert.values(
        key=_key, task_id=sa.bindparam("b_task_id", type_=sa.Text), created=_now,
        expires=sa.bindparam("b_expires", type_=_t.c.expires.type), result=sa.null(),
    )
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[_t.c.key],
        set_={"task_id": excluded.task_id, "created": excluded.created,
              "expires": excluded.expires, "result": sa.null()},
        where=_t.c.expires <= excluded.created,  # a row past its expiry no longer counts
    ).returning(_t.c.task_id, _t.c.result)


def _postgresql() -> Statements:
    claimed = _upsert(postgresql.insert(_t)).cte("claimed")  # type: ignore[attr-defined]
    first = sa.select(sa.true().label("first"), claimed.c.task_id, claimed.c.result)
    earlier = sa.select(sa.false().label("first"), _t.c.task_id, _t.c.result).where(
        _t.c.key == _key, _t.c.expires > _now, ~sa.exists(sa.select(claimed.c.task_id)),
    )
    return Statements(sa.union_all(first, earlier), claim_reads=True)


def _sqlite() -> Statements:
    return Statements(_upsert(sqlite.insert(_t)), claim_reads=False)


_BUILT: dict[str, Statements] = {}


def for_dialect(name: str) -> Statements:
    """The statements for dialect ``name``; ConfigurationError for an unsupported one."""
    built = _BUILT.get(name)
    if built is None:
        if name == "postgresql":
            built = _postgresql()
        elif name == "sqlite":
            built = _sqlite()
        else:
            raise ConfigurationError(
                f"taskdedup.sql supports PostgreSQL (psycopg 3) and SQLite; this connection's "
                f"dialect is {name!r}"
            )
        _BUILT[name] = built
    return built
