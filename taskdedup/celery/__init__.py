"""Celery integration: ``DedupTask`` (the enqueue gate) and signal handlers (the worker guard).

Usage::

    @app.task(base=DedupTask, dedup=Policy(ttl=600))
    def charge(user_id, amount): ...

The caller computes the identity, reserves it and puts the lock key in the message headers,
so the worker never recomputes it. On a ``redis://`` broker that holds the locks the
reservation rides in the push (:class:`RedisTransport`, chosen when a ``DedupTask`` is bound
to the app: one round trip per publish); with the locks elsewhere it is a round trip of its
own, which :func:`batch` pipelines for many calls. On the worker, ``before_start`` claims the
lock (a duplicate's body is skipped: it ends SUCCESS with :func:`skipped_info` set, or FAILURE
with ``DuplicateTaskError`` inside a workflow), and Celery's signals complete or release it.

Modules: :mod:`.task` (DedupTask), :mod:`.signals` (the worker guard's handlers),
:mod:`.transport` (the fused kombu push), :mod:`.fetch` (the reliable fetch, SPEC §17:
``taskdedup_reliable_fetch``), :mod:`.batch`, :mod:`.config` (store, publish path and fetch),
:mod:`._compat` (what taskdedup relies on in kombu and Celery, checked once).
"""

from __future__ import annotations

from . import signals as _signals  # connects the worker guard's handlers
from ._message import HEADER
from .batch import Batch, batch
from .config import get_deduplicator
from .result import DedupResult
from .task import DedupTask, DuplicateExecution, skipped_info
from .transport import TRANSPORT, RedisTransport

__all__ = [
    "HEADER",
    "TRANSPORT",
    "Batch",
    "DedupResult",
    "DedupTask",
    "DuplicateExecution",
    "RedisTransport",
    "batch",
    "get_deduplicator",
    "skipped_info",
]

del _signals
