"""RQ integration: ``DedupQueue`` (the enqueue gate), ``DedupWorker`` (the execution guard) and
``DedupJob`` (cancel/delete release the lock).

Usage::

    q = DedupQueue("default", connection=redis, dedup=Policy(ttl=600))
    job = q.enqueue(send_email, 42)                    # a duplicate returns the original Job
    job = q.enqueue(send_email, 42, dedup_key="welcome-42")

    $ rq worker -w taskdedup.rq.DedupWorker --job-class taskdedup.rq.DedupJob default

The queue computes the identity, reserves it and writes the lock key into
``job.meta["taskdedup"]`` together with the few policy fields the worker needs (mode, ttl,
lease, on_store_error), so the worker never recomputes the identity and needs no
configuration of its own. Where the locks live in the queue's own Redis, the reservation rides
in the script that writes and queues the job (one round trip); otherwise it takes its own.
Inside the work-horse, :meth:`DedupWorker.perform_job` claims the lock before the body runs (a
duplicate finishes without running it), and RQ's own ``handle_job_success`` /
``handle_job_failure`` / ``handle_job_retry`` complete, release or re-reserve it.
``handle_job_failure`` also runs in the worker's main process when the horse was killed, so a
lost horse releases its lock at once; a worker killed as a whole loses its heartbeat and the
lock frees itself within ``lease``.

Jobs without ``meta["taskdedup"]`` (enqueued by a plain ``Queue`` or ``enqueue_job``) are not
guarded: the worker never guesses a policy. The key in the meta is used only when the worker's
deduplicator could have made it for the job's function; otherwise the identity is recomputed.

Modules: ``config`` (which Deduplicator), ``meta`` (what travels in ``job.meta``), ``call``
(the identity of an RQ call), ``job``, ``queue``, ``many`` (``enqueue_many``), ``worker``,
``logs`` (our records in ``rq worker``'s output), ``django`` (``DjangoDedupQueue`` for
django-rq; imported only by those who name it), and ``_compat`` (what differs between RQ
releases, and every private detail of RQ or redis-py this package relies on).
"""

from __future__ import annotations

from .config import get_deduplicator
from .job import DedupJob
from .meta import META_KEY, skipped_info
from .queue import DedupQueue
from .worker import DedupWorker

__all__ = [
    "META_KEY", "DedupJob", "DedupQueue", "DedupWorker", "get_deduplicator", "skipped_info",
]
