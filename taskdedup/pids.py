"""This process's id, read without a system call (``os.getpid`` is one per call on Linux).

The hot paths (a worker's claim, its heartbeat, its counters) ask "am I still the process
that made this?" several times per task, to notice a fork (Celery's prefork pool, RQ's
work-horse). :func:`pid` answers from a value that ``os.register_at_fork`` refreshes in every
child.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

_PID = [os.getpid()]


def _forked() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """This process's id (refreshed after every fork)."""
    return _PID[0]
