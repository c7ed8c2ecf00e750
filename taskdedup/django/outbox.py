"""The transactional outbox on Django's ORM: ``add()`` writes the call into the caller's
``transaction.atomic()`` block, and :class:`DjangoRowSource` is what the relay
(``manage.py taskdedup_relay``) reads.

After the commit the committing process publishes each call at once (Django's ``on_commit``:
a call added inside a savepoint that was rolled back is not published, its row is gone with
it) through taskdedup's gate, then deletes its row. A publish that fails there is logged at
WARNING and left to the relay; it never raises to the caller, whose transaction is already
committed. A call published twice (a process killed after publishing, before deleting) still
runs once: its row's id is its task/job id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from django.db import connections, router, transaction
from django.utils import timezone

from ..exceptions import ConfigurationError
from .models import OutboxRow
from .recorder import SUPPORTED

if TYPE_CHECKING:
    from ..outbox import Backlog, Envelope, Row

__all__ = ["LEASE", "DjangoRowSource", "add", "check_table"]

logger = logging.getLogger("taskdedup")

LEASE: Final = 60.0
"""Seconds a relay holds the rows it took: it moves their ``next_attempt`` that far ahead, so
no other relay takes them meanwhile; a relay that dies mid-batch leaves them to the next one
after that."""


def _alias(using: str | None) -> str:
    return using or router.db_for_write(OutboxRow) or "default"


def _celery_app_of(target: Any) -> Any:
    """The Celery app of a task, or of the task a signature names (None: Celery's current)."""
    app = getattr(target, "app", None)
    if app is None:
        app = getattr(getattr(target, "type", None), "app", None)
    return app


def add(target: Any, *args: Any, using: str | None = None, **kwargs: Any) -> str:
    """Add a call to the outbox in the current ``transaction.atomic()`` block; the id the
    task or job will run under.

    Args:
        target: a Celery task or signature (its options travel with it; ``args``/``kwargs``
            are appended as ``.delay`` would), or an RQ queue (then the first argument is the
            function and the rest its arguments, as in ``Queue.enqueue``).
        using: the database alias whose transaction the row joins (default: the router's
            database for writes of ``OutboxRow``, else ``"default"``). A task keyword
            argument named ``using`` goes in a signature: ``add(task.s(using=...))``.

    Raises:
        ConfigurationError: not inside ``transaction.atomic()`` on that database (the row
            would commit at once, whatever the caller's work does); a database other than
            PostgreSQL and SQLite (MySQL, Oracle: not tested); a target the outbox
            cannot publish, or arguments its serializer refuses (raised here, never later).
    """
    from ..outbox import pack

    alias = _alias(using)
    connection = connections[alias]
    if not connection.in_atomic_block or connection.get_autocommit():
        raise ConfigurationError(
            "taskdedup.django.outbox.add() writes the call into the caller's transaction: call "
            f"it inside `with transaction.atomic(using={alias!r}):` (outside one the row "
            "would commit at once, whatever happens to the work it belongs to)"
        )
    if connection.vendor not in SUPPORTED:
        raise ConfigurationError(
            "taskdedup.django.outbox.add() supports PostgreSQL (psycopg 3) and SQLite, the "
            f"databases it is tested on; database {alias!r} is {connection.vendor!r}"
        )
    envelope = pack(target, *args, **kwargs)
    now = timezone.now()
    OutboxRow.objects.using(alias).create(
        id=envelope.id, kind=envelope.kind, target=envelope.target, body=envelope.body,
        created=now, next_attempt=now, attempts=0,
    )
    transaction.on_commit(partial(_publish_committed, alias, envelope, target), using=alias)
    return envelope.id


def _publish_committed(alias: str, envelope: Envelope, target: Any) -> None:
    """Publish a committed call with the producer's own app or queue, then delete its row; a
    failure leaves the row to the relay."""
    from ..outbox import Publisher, describe

    try:
        if envelope.kind == "rq":
            Publisher().publish(envelope, target)  # the producer's queue, its connection
        else:
            Publisher(celery_app=_celery_app_of(target)).publish(envelope)
    except Exception as exc:  # never raised to the caller: their transaction is committed
        logger.warning(
            "taskdedup: outbox call %s (%s %s) not published after the commit (%s); the "
            "relay will publish it", envelope.id, envelope.kind, envelope.target,
            describe(exc),
        )
        return
    try:
        OutboxRow.objects.using(alias).filter(id=envelope.id).delete()
    except Exception as exc:
        logger.warning(
            "taskdedup: outbox call %s published, but its row was not deleted (%s); the relay "
            "will publish it again, and it will still run once", envelope.id, describe(exc),
        )


def check_table(using: str) -> None:
    """That database ``using`` is configured and its ``taskdedup_outbox`` answers (the
    management commands check it first: a wrong alias, a database that is down or a table
    not migrated is one line and exit 1, not a traceback or a relay warning forever).

    Raises:
        ConfigurationError: saying which, and what to do.
    """
    from django.db import DatabaseError
    from django.utils.connection import ConnectionDoesNotExist

    from ..outbox import describe

    try:
        connections[using]
    except ConnectionDoesNotExist:
        raise ConfigurationError(
            f"--database {using!r} is not a database of settings.DATABASES "
            f"({', '.join(connections.settings) or 'none'})") from None
    try:
        OutboxRow.objects.using(using).exists()
    except DatabaseError as exc:
        raise ConfigurationError(
            f"the outbox table taskdedup_outbox on database {using!r} cannot be read "
            f"({describe(exc)}): is the database up, and migrated (manage.py migrate "
            f"taskdedup --database {using})?") from None


class DjangoRowSource:
    """The relay's rows, over Django's ORM on database ``using``.

    :meth:`take` locks the due rows (PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED``, so
    relays running at once each take their own; SQLite has no row locks: its writes are
    serialized) and moves their ``next_attempt`` :data:`LEASE` seconds ahead in the same
    transaction, so they stay this relay's until it reports them :meth:`done` or
    :meth:`failed`.
    """

    def __init__(self, using: str = "default", *, lease: float = LEASE) -> None:
        self.using = using
        self.lease = lease

    def _rows(self) -> Any:
        return OutboxRow.objects.using(self.using)

    def take(self, limit: int, grace_s: float) -> list[Row]:
        from ..outbox import Envelope, Row

        # A long-running relay: drop a connection the database broke (a restart, a failover)
        # or that CONN_MAX_AGE retired, as Django does between requests; the next query
        # opens a new one.
        connections[self.using].close_if_unusable_or_obsolete()
        now = timezone.now()
        with transaction.atomic(using=self.using):
            due = self._rows().filter(
                created__lte=now - timedelta(seconds=grace_s), next_attempt__lte=now,
            ).order_by("created")
            if connections[self.using].features.has_select_for_update_skip_locked:
                due = due.select_for_update(skip_locked=True)
            taken = list(due[:limit])
            if taken:
                self._rows().filter(id__in=[row.id for row in taken]).update(
                    next_attempt=now + timedelta(seconds=self.lease))
        return [Row(Envelope(row.id, row.kind, row.target, row.body), row.attempts)
                for row in taken]

    def done(self, ids: Sequence[str]) -> None:
        if ids:
            self._rows().filter(id__in=list(ids)).delete()

    def failed(self, id: str, error: str, next_attempt: datetime) -> None:
        from django.db.models import F

        self._rows().filter(id=id).update(
            attempts=F("attempts") + 1, last_error=error[:1000], next_attempt=next_attempt)

    def backlog(self) -> list[Backlog]:
        """The rows waiting, per kind and target (``manage.py taskdedup_outbox_status``)."""
        from django.db.models import Count, Max, Min, Q

        from ..outbox import Backlog

        found = []
        per_target = (self._rows().values("kind", "target").order_by("kind", "target")
                      .annotate(rows=Count("id"), oldest=Min("created"),
                                failing=Count("id", filter=Q(attempts__gt=0)),
                                attempts=Max("attempts")))
        for group in per_target:
            tried = (self._rows().filter(kind=group["kind"], target=group["target"],
                                         attempts__gt=0)
                     .order_by("-attempts").values_list("last_error", flat=True).first())
            found.append(Backlog(group["kind"], group["target"], group["rows"],
                                 group["oldest"], group["failing"], group["attempts"], tried))
        return found
