"""A lock a worker claims for the child it forks to run the body (an RQ work-horse), its lease
renewed by the worker's heartbeat thread while the child runs.

Why: a work-horse is a fresh fork per job, and every thread it starts and every object it
touches first costs it copy-on-write faults; a claim and a heartbeat thread of its own cost
it more than the claim's round trip (SPEC §10, the RQ worker row). The worker claims before
the fork instead, on warm objects, and its heartbeat thread (running anyway) renews the
lease. The child says when it has settled the lock (completed, released or re-reserved it)
through one byte of memory the two share (an anonymous shared mapping made before the fork):
the worker then stops renewing, and does not report a lock the child released as lost.

If the worker dies first (SIGKILL, the OOM killer) the child runs on, and must keep its lease
itself or a redelivered copy could run beside it: on Linux the kernel signals the child when
its parent dies (``PR_SET_PDEATHSIG``), and the child starts renewing then. Where that is not
available, the child renews its lease itself from the start, as a horse always did.
"""

from __future__ import annotations

import _thread
import ctypes
import mmap
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from .events import logger

__all__ = ["ChildLease", "watch_parent"]

PARENT_DEATH_SIGNAL = signal.SIGURG
"""The signal the kernel sends a child whose worker died: ignored by default, so a child that
never installed the handler is not harmed by it."""

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _load_prctl()  # at import, in the worker: its children inherit it ready


def watch_parent(on_death: Callable[[], None]) -> bool:
    """Have ``on_death()`` called, on a thread of its own, when this process's parent dies;
    False when this platform cannot tell (the caller acts as if it had died). Call it in
    the main thread of a freshly forked child, which it then owns the signal of."""
    if _PRCTL is None:
        return False

    def died(_signum: int, _frame: Any) -> None:
        # a signal handler: start a bare thread, take no lock the interrupted code may hold
        _thread.start_new_thread(on_death, ())

    try:
        signal.signal(PARENT_DEATH_SIGNAL, died)
    except ValueError:  # not the main thread
        return False
    if _PRCTL(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
        signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_DFL)
        return False
    return True


class ChildLease:
    """The running lock of ``owner`` on ``key``, claimed by this process for the child it
    is about to fork: :meth:`keep` before the fork, :meth:`adopt` in the child, :meth:`end`
    in the parent once the child has ended."""

    __slots__ = ("_dedup", "_parent", "_shared", "key", "lease_ms", "name", "owner")

    def __init__(self, dedup: Any, name: str, key: str, owner: str, lease_ms: int) -> None:
        self._dedup = dedup
        self.name, self.key, self.owner, self.lease_ms = name, key, owner, lease_ms
        self._shared = mmap.mmap(-1, 1)  # anonymous and shared: the child writes, we read
        self._parent = os.getpid()

    def keep(self) -> bool:
        """Before the fork, once claimed: this process's heartbeat renews the lease until the
        child has settled it. False when the claim took no lock to renew (then
        :meth:`discard` it)."""
        return bool(self._dedup.heartbeat().hand_over(self.key, self.owner, self.settled))

    def discard(self) -> None:
        """Not handed to a child after all (no lock was taken): free the shared byte."""
        self._shared.close()

    def settled(self) -> bool:
        """Whether the child has completed, released or re-reserved the lock (or ended)."""
        try:
            return self._shared[0] == 1
        except ValueError:  # closed by end(): the child has ended
            return True

    def end(self) -> None:
        """In the parent, the child ended (however): stop renewing the lease."""
        self._dedup.stop_heartbeat(self.key, self.owner)
        self._shared.close()

    def adopt(self) -> None:
        """In the child: stopping the lease's heartbeat marks it settled; if the parent dies
        first (or is gone already, or this platform cannot tell), renew it here."""
        self._dedup.adopt(self.key, self.owner, self._settle)
        if not watch_parent(self._take_over) or os.getppid() != self._parent:
            self._take_over()

    def _settle(self) -> None:
        self._shared[0] = 1

    def _take_over(self) -> None:
        if self._shared[0] == 1:
            return  # settled already: nothing left to renew
        logger.debug("taskdedup: %s[%s] renews its own lease from now on (its worker is gone)",
                     self.name, self.owner)
        heartbeat = self._dedup.heartbeat()
        heartbeat.add(self.name, self.key, self.owner, self.lease_ms)
        if self._shared[0] == 1:  # settled while this started: its first beat is lease/3 away
            heartbeat.remove(self.key, self.owner)
