"""This process's id, read without a system call (``os.getpid`` is one per call on Linux), and
locks that a forked child finds free.

The hot paths (a worker's claim, its heartbeat, its counters) ask "am I still the process
that made this?" several times per task, to notice a fork (Celery's prefork pool, RQ's
work-horse). :func:`pid` answers from a value that ``os.register_at_fork`` refreshes in every
child. A :class:`ForkSafeLock` held by another thread at the fork is made anew in the child,
where that thread does not exist and could never release it.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

__all__ = ["ForkSafeLock", "pid"]

_PID = [os.getpid()]
_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


class ForkSafeLock:
    """A ``threading.Lock`` (as a context manager) that every forked child gets free."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()


def _forked() -> None:
    _PID[0] = os.getpid()
    for lock in list(_LOCKS):
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """This process's id (refreshed after every fork)."""
    return _PID[0]
