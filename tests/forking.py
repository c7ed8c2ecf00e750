"""Fork while another thread holds a lock: what a forked child (an RQ work-horse, a Celery
pool process forked anew) finds of its parent's locks."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def child_runs_while_held(lock: AbstractContextManager[Any], action: Callable[[], bool],
                          timeout: float = 5.0) -> bool:
    """Fork while another thread of this process holds ``lock``; in the child, run
    ``action`` in a thread: whether it returned True within ``timeout`` (False when it hung
    on a lock the fork copied held)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's exit code is the answer
            done: list[bool] = []
            runner = threading.Thread(target=lambda: done.append(action()), daemon=True)
            runner.start()
            runner.join(timeout)
            os._exit(0 if done == [True] else 1)
        _, status = os.waitpid(child, 0)
        return os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join(10)
