"""The handle a gated call returns: Celery's ``AsyncResult``, whose ``revoke()`` frees the
identity at once.

Celery's revoke is a broadcast: a worker drops the message when it gets to it, and only then
does ``task_revoked`` release the lock. Until then the revoked call still holds its
reservation, and the same call made right after the revoke ("cancel, then send it again")
would be dropped as a duplicate of a call that will never run. ``revoke()`` on this handle
first releases the revoked id's reservation — only while it is ``queued``: a running body
keeps its lock until it ends or is terminated — then broadcasts as Celery does. A handle
rebuilt from an id alone (``AsyncResult(id)``) does not know the lock key, and
``app.control.revoke(id)`` bypasses the handle: both free the identity when a worker drops
the message, as before.
"""

from __future__ import annotations

from typing import Any

from celery.result import AsyncResult

__all__ = ["DedupResult"]


class DedupResult(AsyncResult):  # type: ignore[misc]
    """``AsyncResult`` of a :class:`~taskdedup.celery.DedupTask`: ``lock_task`` is the task's
    name, ``lock_key`` the lock its call reserved (None when unknown: a handle rebuilt from an
    id)."""

    lock_task: str | None = None
    lock_key: str | None = None

    def revoke(self, connection: Any = None, terminate: bool = False, signal: Any = None,
               wait: bool = False, timeout: float | None = None) -> Any:
        """Release this id's queued reservation, then Celery's revoke (same arguments)."""
        self.release_queued()
        return super().revoke(connection=connection, terminate=terminate, signal=signal,
                              wait=wait, timeout=timeout)

    def release_queued(self) -> bool:
        """Release the lock this call reserved while it is still ``queued`` by this id (a
        compare-and-delete; never raises). True when it was released."""
        from .config import get_deduplicator
        from .task import DedupTask

        key = self.lock_key
        task = self.app.tasks.get(self.lock_task) if self.lock_task else None
        if not key or not isinstance(task, DedupTask) or task._dedup_policy is None:
            return False
        return get_deduplicator(self.app).release(task.name, key, self.id, reason="revoked",
                                                  only_queued=True)
