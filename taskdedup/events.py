"""A closed set of events, and listeners that observe them (metrics, logging, tests).

The core emits one event per decision: a :class:`DedupEvent` to listeners that take one, its
fields to those that only count (``tally``). Listeners run inline and must be cheap;
an exception in a listener is logged and never reaches the task or the caller.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from .pids import ForkSafeLock

__all__ = ["FOLD_AT", "Counters", "DedupEvent", "Event", "Events", "Fields", "Listener", "logger"]

logger = logging.getLogger("taskdedup")
# A library logs, the application decides where it goes: without this, Python's last-resort
# handler would print our WARNINGs to stderr in apps that configured no logging. Levels:
# DEBUG for each dropped, replaced or skipped duplicate (they are counted: watch the counts),
# INFO for one-time choices and self-healing, WARNING for what needs action. `rq worker`
# configures no root logger: DedupWorker sends our records to its own output
# (taskdedup.rq.logs).
logger.addHandler(logging.NullHandler())

FOLD_AT = 256
"""Events an in-process counter keeps before it counts them (bounded memory between reads)."""


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

Fields = tuple[Event, str, str, str | None, str | None, str | None, float | None]
"""One event's fields, in :class:`DedupEvent`'s order: what a counting listener's ``tally``
gets, with no event object made for it."""


class Events:
    """The listeners of one :class:`~taskdedup.core.Deduplicator`, and the process-wide ones
    every Deduplicator calls too (:meth:`add_everywhere`: an instrumentor that knows no app).

    A listener that only counts (:class:`Counters`, :class:`~taskdedup.stats.StatsRecorder`)
    may have a ``tally(fields)`` method: it is called with the event's :data:`Fields`
    instead, and where every listener is such a one no :class:`DedupEvent` is made — the
    worker and the publisher make one or two events each call."""

    _everywhere: tuple[Listener, ...] = ()

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._tallies: tuple[Callable[[Fields], None], ...] = ()
        self._full: tuple[Listener, ...] = ()  # the listeners called with a DedupEvent

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
        self._sort((*self._listeners, listener))
        return listener

    def remove(self, listener: Listener) -> None:
        self._sort(tuple(x for x in self._listeners if x is not listener))

    def _sort(self, listeners: tuple[Listener, ...]) -> None:
        tallies = tuple(getattr(x, "tally", None) for x in listeners)
        self._full = tuple(x for x, tally in zip(listeners, tallies, strict=True)
                           if not callable(tally))
        self._tallies = tuple(tally for tally in tallies if callable(tally))
        self._listeners = listeners

    def record(self, event: Event, task: str, key: str, task_id: str | None = None,
               existing_id: str | None = None, detail: str | None = None,
               seconds: float | None = None) -> None:
        """Emit one event from its fields (the core's hot path): a :class:`DedupEvent` is
        made only for listeners that take one."""
        self._send((event, task, key, task_id, existing_id, detail, seconds), None)

    def emit(self, event: DedupEvent) -> None:
        """Emit ``event`` to every listener."""
        self._send((event.event, event.task, event.key, event.task_id, event.existing_id,
                    event.detail, event.seconds), event)

    def _send(self, fields: Fields, made: DedupEvent | None) -> None:
        for tally in self._tallies:
            try:
                tally(fields)
            except Exception:  # a listener must never break a task
                logger.exception("taskdedup event listener %r failed", tally)
        everywhere = Events._everywhere
        full = self._full + everywhere if everywhere else self._full
        if not full:
            return
        if made is None:
            made = DedupEvent(*fields)
        for listener in full:
            try:
                listener(made)
            except Exception:  # a listener must never break a task
                logger.exception("taskdedup event listener %r failed", listener)


class Counters:
    """In-process counts per (task, event): no Redis round trip, read with :meth:`snapshot`.

    An event is kept in a queue as it comes (an append, no lock: the worker's and the
    publisher's hot paths), and counted when the counts are read or every
    :data:`FOLD_AT` events."""

    def __init__(self) -> None:
        # a forked child (an RQ work-horse) counts at once: never a lock that a thread of the
        # parent (its heartbeat, reporting a lost lease) held at the fork
        self._lock = ForkSafeLock()
        self._counts: Counter[tuple[str, Event]] = Counter()
        self._seen: deque[tuple[str, Event]] = deque()

    def __call__(self, event: DedupEvent) -> None:
        self._keep((event.task, event.event))

    def tally(self, fields: Fields) -> None:
        """Count one event from its fields (:meth:`Events.record`)."""
        self._keep((fields[1], fields[0]))

    def _keep(self, counted: tuple[str, Event]) -> None:
        seen = self._seen
        seen.append(counted)
        if len(seen) >= FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Count the events kept so far (under ``_lock``; an event appended meanwhile is
        counted now or by the next fold, never twice: each is taken out once)."""
        seen, counts = self._seen, self._counts
        while seen:
            counts[seen.popleft()] += 1

    def get(self, event: Event, task: str | None = None) -> int:
        with self._lock:
            self._fold()
            return sum(n for (t, e), n in self._counts.items() if e is event and task in (None, t))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{task: {event: count}}``."""
        with self._lock:
            self._fold()
            out: dict[str, dict[str, int]] = {}
            for (task, event), n in self._counts.items():
                out.setdefault(task, {})[event.value] = n
            return out

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
            self._counts.clear()
