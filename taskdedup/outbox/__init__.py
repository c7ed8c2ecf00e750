"""The transactional outbox, framework-free core (SPEC §14).

A call is written into the caller's own transaction as a row of ``taskdedup_outbox`` (an
:class:`Envelope`: its id, kind, target and JSON body, built by :func:`pack`), published by
the committing process right after the commit, and by a relay (:class:`Relay`) if that
process died first or the broker was down. Publishing goes through taskdedup's gate with the
row's id as the task/job id (:class:`Publisher`), so a row published twice runs once.

The database layers build on this package: ``taskdedup.sql.outbox`` (SQLAlchemy) and
``taskdedup.django.outbox`` (Django's ORM). It imports neither, nor Celery or RQ: a call's
adapter (``taskdedup.celery.outbox``, ``taskdedup.rq.outbox``) is imported when a call
targets that framework.

The table, identical in both layers: ``id`` TEXT primary key (the task/job id), ``kind``
VARCHAR(16) (``celery``/``rq``), ``target`` VARCHAR(255) (task name / queue name), ``body``
TEXT (the envelope's JSON), ``created`` and ``next_attempt`` (timestamps with time zone,
``next_attempt`` indexed: ``ix_taskdedup_outbox_next_attempt``), ``attempts`` INTEGER
DEFAULT 0, ``last_error`` TEXT NULL.
"""

from __future__ import annotations

from typing import Final

from .envelope import CELERY, KINDS, RQ, Envelope, pack
from .publisher import Publisher, PublishError, describe
from .relay import (
    DEFAULT_BATCH,
    DEFAULT_GRACE,
    DEFAULT_POLL,
    MAX_BACKOFF,
    Backlog,
    Relay,
    Row,
    RowSource,
    backoff,
)

__all__ = [
    "CELERY", "DEFAULT_BATCH", "DEFAULT_GRACE", "DEFAULT_POLL", "KINDS", "MAX_BACKOFF", "RQ",
    "TABLE_NAME", "Backlog", "Envelope", "PublishError", "Publisher", "Relay", "Row",
    "RowSource", "backoff", "describe", "pack",
]

TABLE_NAME: Final = "taskdedup_outbox"
