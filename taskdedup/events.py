"""A closed set of events, and listeners that observe them (metrics, logging, tests).

The core emits one :class:`DedupEvent` per decision. Listeners run inline and must be cheap;
an exception in a listener is logged and never reaches the task or the caller.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from .pids import ForkSafeLock

__all__ = ["Counters", "DedupEvent", "Event", "Events", "Listener", "logger"]

logger = logging.getLogger("taskdedup")
# A library logs, the application decides where it goes: without this, Python's last-resort
# handler would print our WARNINGs to stderr in apps that configured no logging. Levels:
# DEBUG for each dropped, replaced or skipped duplicate (they are counted: watch the counts),
# INFO for one-time choices and self-healing, WARNING for what needs action. `rq worker`
# configures no root logger: DedupWorker sends our records to its own output
# (taskdedup.rq.logs).
logger.addHandler(logging.NullHandler())


class Event(StrEnum):
    """Everything taskdedup reports. The set is closed: listeners can match exhaustively."""

    RESERVED = "reserved"
    """An enqueue was accepted and its identity reserved."""
    DUPLICATE = "duplicate"
    """An enqueue was a duplicate (returned, raised, dropped or replaced per on_duplicate)."""
    CLAIMED = "claimed"
    """A worker took the running lock; the body runs."""
    SKIPPED = "skipped"
    """A worker found the identity held by another id (or done): the body did not run."""
    DEFERRED = "deferred"
    """A worker found its own id running: another copy of the same message (kombu restores
    unacked ETA/countdown messages every ``visibility_timeout``) runs now; this copy is put
    off, neither run nor failed nor counted as a retry."""
    COMPLETED = "completed"
    """The body succeeded; the lock was released or kept as done for ``ttl``."""
    RELEASED = "released"
    """The lock was released: final failure, revoke, reject, ignore, replace, publish error."""
    LEASE_LOST = "lease_lost"
    """A running lock was no longer ours at heartbeat or completion (it had expired)."""
    STORE_ERROR = "store_error"
    """Redis could not be reached; what followed is per ``on_store_error``."""
    LIMITED = "limited"
    """A worker put off a call its per-key limit refused (SPEC §16): republished for later,
    neither run nor failed nor counted as a retry, holding no worker slot; ``detail``
    ``concurrency`` or ``rate`` (the limit that was full)."""
    DROPPED = "dropped"
    """A worker dropped a call its limit refused (``on_excess="drop"``, SPEC §16): the body
    did not run; the call ended in a state that says so."""
    FOREIGN = "foreign"
    """A lock key holds a value taskdedup did not write: the call or execution it blocked is
    reported at WARNING (inspect or clear the key)."""


@dataclass(frozen=True, slots=True)
class DedupEvent:
    """One occurrence. Never carries argument values."""

    event: Event
    task: str
    key: str
    task_id: str | None = None
    existing_id: str | None = None
    detail: str | None = None
    seconds: float | None = None
    """Time the store call took (gate latency), when measured."""


Listener = Callable[[DedupEvent], None]


class Events:
    """The listeners of one :class:`~taskdedup.core.Deduplicator`, and the process-wide ones
    every Deduplicator calls too (:meth:`add_everywhere`: an instrumentor that knows no app)."""

    _everywhere: tuple[Listener, ...] = ()

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()

    @classmethod
    def add_everywhere(cls, listener: Listener) -> Listener:
        """Register ``listener`` for the events of every Deduplicator in this process."""
        Events._everywhere = (*Events._everywhere, listener)
        return listener

    @classmethod
    def remove_everywhere(cls, listener: Listener) -> None:
        Events._everywhere = tuple(x for x in Events._everywhere if x is not listener)

    def add(self, listener: Listener) -> Listener:
        """Register ``listener`` (usable as a decorator); returns it."""
        self._listeners = (*self._listeners, listener)
        return listener

    def remove(self, listener: Listener) -> None:
        self._listeners = tuple(x for x in self._listeners if x is not listener)

    def emit(self, event: DedupEvent) -> None:
        for listener in self._listeners + Events._everywhere:
            try:
                listener(event)
            except Exception:  # a listener must never break a task
                logger.exception("taskdedup event listener %r failed", listener)


class Counters:
    """In-process counts per (task, event): no Redis round trip, read with :meth:`snapshot`."""

    def __init__(self) -> None:
        # a forked child (an RQ work-horse) counts at once: never a lock that a thread of the
        # parent (its heartbeat, reporting a lost lease) held at the fork
        self._lock = ForkSafeLock()
        self._counts: Counter[tuple[str, Event]] = Counter()

    def __call__(self, event: DedupEvent) -> None:
        with self._lock:
            self._counts[(event.task, event.event)] += 1

    def get(self, event: Event, task: str | None = None) -> int:
        with self._lock:
            return sum(n for (t, e), n in self._counts.items() if e is event and task in (None, t))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{task: {event: count}}``."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (task, event), n in self._counts.items():
                out.setdefault(task, {})[event.value] = n
            return out

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
