"""``DedupJob``: an RQ job whose ``cancel()`` and ``delete()`` release its reservation."""

from __future__ import annotations

from typing import Any

from rq.job import Job

from ..core import Deduplicator
from . import _compat
from .config import get_deduplicator
from .meta import Guard, guard_of, skipped_info

__all__ = ["DedupJob"]


class DedupJob(Job):
    """An RQ job whose ``cancel()`` and ``delete()`` release its reservation.

    Only a job that has not started is released (queued, scheduled, deferred): a running job
    keeps its lock until the worker completes or releases it, and a finished job keeps its
    ``until_expired`` window. The release is compare-and-delete by the job id, so it never
    touches a lock another job holds. Use it as the worker's ``--job-class`` and wherever
    jobs are fetched (:class:`~taskdedup.rq.DedupQueue` uses it by default).
    """

    _taskdedup: Deduplicator | None = None

    @property
    def dedup(self) -> Deduplicator:
        """The deduplicator of the queue that made or fetched this job, else the default."""
        if self._taskdedup is None:
            self._taskdedup = get_deduplicator(self.connection)
        return self._taskdedup

    @property
    def success_callback(self) -> Any:
        """No ``on_success`` callback for a skipped duplicate: its body did not run."""
        if skipped_info(self) is not None:
            return None
        return super().success_callback

    def cancel(
        self, pipeline: Any = None, enqueue_dependents: bool = False,
        remove_from_dependencies: bool = False,
    ) -> dict[str, list[str]]:
        """Cancel the job (RQ) and release its reservation if it had not started."""
        guard = self._unstarted_guard(pipeline)
        result = super().cancel(
            pipeline=pipeline, enqueue_dependents=enqueue_dependents,
            remove_from_dependencies=remove_from_dependencies,
        )
        if guard is not None:
            self.dedup.release(guard.name, guard.key, self.id, reason="canceled",
                               only_queued=True)
        return result

    def delete(
        self, pipeline: Any = None, remove_from_queue: bool = True, delete_dependents: bool = False
    ) -> None:
        """Delete the job (RQ) and release its reservation if it had not started."""
        guard = self._unstarted_guard(pipeline)
        super().delete(pipeline=pipeline, remove_from_queue=remove_from_queue,
                       delete_dependents=delete_dependents)
        if guard is not None:
            self.dedup.release(guard.name, guard.key, self.id, reason="deleted",
                               only_queued=True)

    def _unstarted_guard(self, pipeline: Any) -> Guard | None:
        """The guard to release after cancel/delete: only without a caller's pipeline (RQ's
        own cleanup passes one; an unexecuted pipeline must not release anything) and only
        for a job that has not started."""
        guard = guard_of(self) if pipeline is None else None
        if guard is None:
            return None
        raw = self.connection.hget(self.key, "status")
        status = raw.decode() if isinstance(raw, bytes) else raw
        return guard if status in _compat.NOT_STARTED else None
