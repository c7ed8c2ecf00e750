"""The relay: publish what was committed but not published, written once for every database
layer over a :class:`RowSource` (SQLAlchemy: :mod:`taskdedup.sql.outbox`; Django:
:mod:`taskdedup.django.outbox`).

A row is taken once it is older than the grace period (its producer had time to publish and
delete it itself) and due (``next_attempt``). Published rows are deleted in one statement per
batch; a row that fails stays, its ``attempts`` counted, ``last_error`` kept and its next
attempt pushed back exponentially (1 s doubling to 5 min), logged at WARNING with its id and
target — never dropped, never a hot loop. A row published twice (a relay killed after the
publish, before the delete; a producer and a relay racing) still runs once: its id is its
identity (SPEC §5).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

from ..events import logger
from .envelope import Envelope
from .publisher import Publisher, PublishError

__all__ = [
    "DEFAULT_BATCH", "DEFAULT_GRACE", "DEFAULT_POLL", "MAX_BACKOFF", "Backlog", "Relay", "Row",
    "RowSource", "backoff",
]

DEFAULT_GRACE: Final = 10.0
"""Seconds a row waits before a relay takes it: the committing process publishes its own rows
within milliseconds of the commit, so a row older than this was left behind."""
DEFAULT_BATCH: Final = 100
DEFAULT_POLL: Final = 1.0
"""Seconds an idle relay waits before it looks again."""
MAX_BACKOFF: Final = 300.0


def backoff(attempts: int) -> float:
    """Seconds before the next attempt of a row that failed ``attempts`` times (1, 2, 4, ...
    up to :data:`MAX_BACKOFF`)."""
    return min(MAX_BACKOFF, 2.0 ** max(0, min(attempts - 1, 30)))


@dataclass(frozen=True, slots=True)
class Row:
    """A row the relay took: its envelope and how many publishes of it failed so far."""

    envelope: Envelope
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class Backlog:
    """What ``status`` reports for one target (a Celery task or an RQ queue)."""

    kind: str
    target: str
    rows: int
    oldest: datetime
    failing: int
    """Rows whose last publish failed (``attempts`` > 0)."""
    attempts: int
    """The most attempts of one row."""
    last_error: str | None
    """The last error of the row tried most."""

    def as_dict(self, now: datetime) -> dict[str, object]:
        return {"kind": self.kind, "target": self.target, "rows": self.rows,
                "oldest_age_s": round(max(0.0, (now - self.oldest).total_seconds()), 3),
                "failing": self.failing, "attempts": self.attempts,
                "last_error": self.last_error}


class RowSource(Protocol):
    """Where the relay takes rows from; one batch at a time, from one thread.

    A batch is ``take``, then ``failed`` for each row that could not be published, then
    ``done`` once (also with no ids), which ends the batch: rows a database locked for this
    relay (PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so several relays share the table) stay
    locked from ``take`` to ``done``.
    """

    def take(self, limit: int, grace_s: float) -> list[Row]:
        """Up to ``limit`` rows created at least ``grace_s`` ago whose ``next_attempt`` has
        come, oldest first."""

    def failed(self, id: str, error: str, next_attempt: datetime) -> None:
        """Count a failed attempt of row ``id``: ``attempts`` + 1, ``last_error``,
        ``next_attempt``."""

    def done(self, ids: Sequence[str]) -> None:
        """Delete the published rows ``ids`` (one statement) and end the batch."""


class Relay:
    """Publishes the rows of ``source`` with ``publisher``, in batches, until stopped.

    Args:
        source: the table (:class:`RowSource`).
        publisher: how rows are published (its Celery app, its RQ connection).
        batch: rows per batch.
        grace: seconds a row waits before this relay takes it.
        poll: seconds to wait when there was nothing to do.
    """

    def __init__(self, source: RowSource, publisher: Publisher, *, batch: int = DEFAULT_BATCH,
                 grace: float = DEFAULT_GRACE, poll: float = DEFAULT_POLL) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        if grace < 0 or poll <= 0:
            raise ValueError("grace must be >= 0 and poll > 0")
        self.source, self.publisher = source, publisher
        self.batch, self.grace, self.poll = batch, grace, poll

    def run_once(self) -> int:
        """One batch: publish, delete what was published, back off what failed. Returns the
        number of rows taken."""
        rows = self.source.take(self.batch, self.grace)
        published: list[str] = []
        try:
            for row in rows:
                try:
                    self.publisher.publish(row.envelope)
                except PublishError as exc:
                    attempts = row.attempts + 1
                    delay = backoff(attempts)
                    logger.warning(
                        "taskdedup: outbox row %s (%s %s) not published (attempt %d): %s; "
                        "next attempt in %.0fs", row.envelope.id, row.envelope.kind,
                        row.envelope.target, attempts, exc.reason, delay)
                    self.source.failed(row.envelope.id, exc.reason,
                                       datetime.now(UTC) + timedelta(seconds=delay))
                else:
                    published.append(row.envelope.id)
        finally:
            self.source.done(published)
        if published:
            logger.info("taskdedup: outbox relay published %d row(s)", len(published))
        return len(rows)

    def run(self, stop: threading.Event) -> None:
        """Run batches until ``stop`` is set; the batch under way when it is set finishes.
        A full batch is followed at once by the next; otherwise the relay waits ``poll``."""
        while not stop.is_set():
            try:
                taken = self.run_once()
            except Exception as exc:  # the database is unreachable: say so, try again later
                logger.warning("taskdedup: outbox relay could not read its rows: %s: %s",
                               type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                taken = 0
            if taken < self.batch:  # a full batch is followed at once by the next
                stop.wait(self.poll)
