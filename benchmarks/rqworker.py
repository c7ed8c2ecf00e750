"""A non-forking DedupWorker for the RQ SimpleWorker comparison."""

from __future__ import annotations

from rq.worker import SimpleWorker

from taskdedup.rq import DedupWorker

__all__ = ["DedupSimpleWorker"]


class DedupSimpleWorker(SimpleWorker, DedupWorker):  # type: ignore[misc]
    """A DedupWorker that runs jobs in its own process, composed here: taskdedup ships no
    simple-worker variant.

    ``SimpleWorker.execute_job`` runs ``perform_job`` in the worker process, and
    ``DedupWorker.perform_job`` / ``handle_job_*`` guard it, exactly as in a work-horse.
    """
