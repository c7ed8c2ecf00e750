"""Operating the table: create it (idempotent) and prune expired rows in short batches."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

import sqlalchemy as sa

from .schema import TABLE
from .statements import for_dialect

__all__ = ["DEFAULT_BATCH", "engine_from_url", "init", "prune"]

DEFAULT_BATCH: Final = 1000


def engine_from_url(url: str) -> sa.Engine:
    """An Engine for ``url`` (PostgreSQL or SQLite); a bare ``postgresql://`` URL uses
    psycopg 3 (SQLAlchemy's own default would be psycopg2)."""
    parsed = sa.make_url(url)
    for_dialect(parsed.get_backend_name())  # ConfigurationError names the supported ones
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return sa.create_engine(parsed)


def init(engine: sa.Engine) -> bool:
    """Create ``taskdedup_effects`` and its index unless they exist; True if it was created."""
    for_dialect(engine.dialect.name)  # refuse an unsupported database before touching it
    with engine.begin() as conn:
        existed = sa.inspect(conn).has_table(TABLE.name)
        TABLE.metadata.create_all(conn, checkfirst=True)
    return not existed


def prune(engine: sa.Engine, *, batch: int = DEFAULT_BATCH, now: datetime | None = None) -> int:
    """Delete the rows past their expiry, ``batch`` rows per transaction; return how many.

    Each batch is its own short transaction, so no lock is held for long. On PostgreSQL the
    batch skips rows a running task holds (``FOR UPDATE SKIP LOCKED``: a run taking over an
    expired row); they are either renewed by that run or deleted by the next prune.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    for_dialect(engine.dialect.name)
    cutoff = now or datetime.now(UTC)
    t = TABLE
    expired = sa.select(t.c.key).where(t.c.expires <= cutoff).limit(batch)
    if engine.dialect.name == "postgresql":
        expired = expired.with_for_update(skip_locked=True)
    delete = sa.delete(t).where(t.c.key.in_(expired.scalar_subquery()))
    total = 0
    while True:
        with engine.begin() as conn:
            deleted = conn.execute(delete).rowcount
        total += deleted
        if deleted < batch:
            return total
