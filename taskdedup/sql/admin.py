"""Operating the table: create it (idempotent) and prune expired rows in short batches."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

import sqlalchemy as sa

from .schema import OUTBOX, TABLE
from .statements import for_dialect

__all__ = ["DEFAULT_BATCH", "create_tables", "engine_from_url", "init", "prune"]

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
    """Create ``taskdedup_effects`` and ``taskdedup_outbox`` (and their indexes) unless they
    exist; True if ``taskdedup_effects`` was created."""
    return TABLE.name in create_tables(engine)


def create_tables(engine: sa.Engine) -> list[str]:
    """Create the tables of the durable tier that do not exist yet; return their names."""
    for_dialect(engine.dialect.name)  # refuse an unsupported database before touching it
    with engine.begin() as conn:
        inspector = sa.inspect(conn)
        missing = [t.name for t in (TABLE, OUTBOX) if not inspector.has_table(t.name)]
        TABLE.metadata.create_all(conn, checkfirst=True)  # OUTBOX is on the same metadata
    return missing


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
