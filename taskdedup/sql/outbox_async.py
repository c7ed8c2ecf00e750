"""``await outbox.add(aconn, target, *args, **kwargs)``: the outbox on asyncio SQLAlchemy
(``AsyncConnection`` / ``AsyncSession``, e.g. a FastAPI producer), SPEC §14.

::

    from taskdedup.sql import outbox

    async with async_session() as session, session.begin():
        session.add(Order(ref="ORD-7", cents=5000))
        task_id = await outbox.add(session, charge.s("ORD-7", 5000))
    # committed: published now by this process; if it died first, by the relay

The call is the sync :func:`taskdedup.sql.outbox.add` run on the sync ``Connection``/
``Session`` behind the async one (``run_sync``: SQLAlchemy's own bridge, one ``INSERT``
awaited). So the after-commit publish is the sync one, hooked on ``asession.sync_session``
(its ``after_commit``) or on ``aconn.sync_connection`` (its return to the pool, or its next
transaction): every rule of the sync outbox holds (rollback and savepoints forget the rows, a
refused commit publishes nothing, a failed publish is left to the relay).

The publish itself is sync redis-py, run inside the ``await`` of the commit (or of the
connection's close): one gated round trip to Redis per row, then one ``DELETE`` of the
published rows, awaited like any statement. For a producer that sends a few calls per
request this costs the event loop about what one awaited Redis command would; a request that
adds thousands of rows in one transaction blocks the loop for their round trips (use the
relay for bulk work: add the rows, let ``taskdedup outbox relay`` publish them).
"""

from __future__ import annotations

from typing import Any

from ..exceptions import ConfigurationError

__all__ = ["add"]


async def add(conn: Any, target: Any, *args: Any, **kwargs: Any) -> str:
    """Write the call ``target(*args, **kwargs)`` into ``conn``'s transaction (an
    ``AsyncConnection`` or ``AsyncSession``); it is published after the commit. Returns the
    id the task/job will run under. Same arguments and errors as the sync
    :func:`taskdedup.sql.outbox.add`."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from .outbox import add as add_sync

    if isinstance(conn, (AsyncSession, AsyncConnection)):
        task_id: str = await conn.run_sync(add_sync, target, *args, **kwargs)
        return task_id
    raise ConfigurationError(
        "`await outbox.add(conn, ...)` takes an AsyncConnection or AsyncSession (a sync "
        f"Connection or Session takes `outbox.add(conn, ...)` without await), not "
        f"{type(conn).__name__}"
    )
