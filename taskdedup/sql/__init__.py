"""The durable tier: a task's identity recorded in the task's own database transaction.

The Redis lock is the fast first pass; a row in ``taskdedup_effects``, written by the same
transaction as the task's own writes, is the authority: both commit or neither does, so a body
killed at any point and redelivered performs its database effects exactly once::

    from taskdedup.sql import effects

    with engine.begin() as conn:               # the task's own transaction
        with effects(conn) as fx:              # key: the running task's identity
            if not fx.first:
                return fx.result               # an earlier run committed: nothing is redone
            conn.execute(ledger.insert().values(order_id=order_id, cents=cents))
            fx.result = {"charged": cents}     # stored with the row, same transaction

SQLAlchemy 2 (``pip install 'taskdedup[sql]'``; PostgreSQL also needs psycopg 3:
``'taskdedup[sql,postgres]'``). Supported dialects: PostgreSQL (psycopg 3) and SQLite.
SQLAlchemy is imported when a name of this package is first used, so ``taskdedup sql``'s
help works without it.

Modules: ``schema`` (the tables), ``statements`` (the one statement per dialect), ``recorder``
(the context manager), ``outbox`` (the transactional outbox: ``outbox.add(conn, target, ...)``,
SPEC §14), ``admin`` (create the tables, prune expired rows), ``cli`` (``taskdedup sql init`` /
``prune``), ``outbox_cli`` (``taskdedup outbox relay`` / ``status``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admin import init, prune
    from .recorder import DEFAULT_TTL, Effects, effects
    from .schema import OUTBOX_TABLE_NAME, TABLE_NAME, outbox_table, table

__all__ = ["DEFAULT_TTL", "OUTBOX_TABLE_NAME", "TABLE_NAME", "Effects", "effects", "init",
           "outbox_table", "prune", "table"]

_WHERE = {
    "DEFAULT_TTL": "recorder", "Effects": "recorder", "effects": "recorder",
    "TABLE_NAME": "schema", "table": "schema", "init": "admin", "prune": "admin",
    "OUTBOX_TABLE_NAME": "schema", "outbox_table": "schema",
}

INSTALL_HINT = "pip install 'taskdedup[sql]'"


def require_sqlalchemy() -> None:
    """Raise ImportError with the install command when SQLAlchemy 2 is missing."""
    try:
        import sqlalchemy
    except ImportError as exc:
        raise ImportError(f"taskdedup.sql needs SQLAlchemy 2: {INSTALL_HINT}") from exc
    if int(sqlalchemy.__version__.split(".")[0]) < 2:
        raise ImportError(
            f"taskdedup.sql needs SQLAlchemy 2 (found {sqlalchemy.__version__}): {INSTALL_HINT}"
        )


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_sqlalchemy()
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
