"""What the dashboard reads from Redis, and the short history it keeps in its own memory.

No web framework here: pages of locks found with SCAN and a cursor (never KEYS), an overview
over a capped number of keys, one lock, the fenced clear, and :class:`StatsHistory`, which
samples the counters that producers and workers already flush (``{prefix}:stats:{task}``,
:mod:`taskdedup.stats`) into a bounded deque. Sampling happens in the dashboard's process:
the task's hot path gets no extra round trip, and nothing new is written to Redis.

Lock keys hold only the digest of a call's arguments, and lock values only a state, an
optional digest and the owner's task id: nothing read here can show an argument value.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from ..events import logger
from ..locks import Lock, key_bytes, key_text, lock_pattern, read_locks, split_key, to_lock
from ..stats import TaskStats, read_stats
from ..stores.base import Outcome
from ..stores.redis import RedisStore

__all__ = [
    "FirstSeen",
    "LockPage",
    "Overview",
    "Sample",
    "StatsHistory",
    "clear_lock",
    "lock_page",
    "overview",
    "read_lock",
]

STATES: Final = ("queued", "running", "done")
_SCAN_COUNT: Final = 500
_MAX_SCAN_CALLS: Final = 50


# -- when a lock was first seen ------------------------------------------------------------------


class FirstSeen:
    """When this process first saw each (key, owner): the age of a lock, as far as we know.

    Redis does not record when a key was written, so "the oldest locks" are those this
    dashboard has seen for the longest. A new owner of the same key starts again. Bounded:
    the least recently seen entries are dropped beyond ``limit``.
    """

    def __init__(self, limit: int = 50_000, clock: Any = time.time) -> None:
        self.limit = limit
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def see(self, locks: Sequence[Lock]) -> dict[str, float]:
        """Note ``locks``; ``{key: first seen (epoch seconds)}`` for each of them."""
        now = self._clock()
        out: dict[str, float] = {}
        with self._lock:
            for lock in locks:
                ident = (lock.key, lock.owner)
                first = self._seen.pop(ident, now)
                self._seen[ident] = first  # most recently seen last
                out[lock.key] = first
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
        return out


# -- locks -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockPage:
    """One page of locks: ``cursor`` continues the SCAN (0 when it is complete)."""

    locks: list[Lock]
    cursor: int
    first_seen: dict[str, float] = field(default_factory=dict)


def _scan_locks(
    client: redis.Redis, prefix: str, task: str | None, cursor: int, count: int = _SCAN_COUNT,
    scope: str | None = None,
) -> tuple[int, list[Lock]]:
    """One SCAN call from ``cursor`` and the locks (of exactly ``task`` in ``scope``) among
    the keys it returned."""
    cursor, keys = client.scan(cursor, match=lock_pattern(prefix, task, scope), count=count)
    names = [key_text(key) for key in keys]
    return int(cursor), (read_locks(client, prefix, names, task, scope) if names else [])


def lock_page(
    client: redis.Redis,
    prefix: str,
    *,
    task: str | None = None,
    state: str | None = None,
    cursor: int = 0,
    limit: int = 200,
    seen: FirstSeen | None = None,
    scope: str | None = None,
) -> LockPage:
    """Locks (of exactly ``task`` in ``scope``, in ``state``) from ``cursor`` on, about
    ``limit`` of them.

    SCAN calls continue until ``limit`` locks are found, the scan ends, or
    ``_MAX_SCAN_CALLS`` calls were made (a sparse keyspace does not hold a request
    for long); every lock a SCAN call returned is kept, so resuming at the returned cursor
    skips none.
    """
    found: list[Lock] = []
    count = max(10, min(_SCAN_COUNT, limit))
    for _ in range(_MAX_SCAN_CALLS):
        cursor, locks = _scan_locks(client, prefix, task, cursor, count, scope)
        found.extend(lock for lock in locks if state is None or lock.state == state)
        if cursor == 0 or len(found) >= limit:
            break
    found.sort(key=lambda lock: (lock.task, lock.scope, lock.key))
    return LockPage(found, cursor, seen.see(found) if seen is not None else {})


@dataclass(frozen=True)
class Overview:
    """Counts by (task, scope) and state, and the locks worth a look, over up to ``cap``
    keys."""

    counts: dict[tuple[str, str], dict[str, int]]
    soonest: list[Lock]
    oldest: list[tuple[Lock, float]]
    no_expiry: int
    locks: int
    complete: bool


def overview(
    client: redis.Redis, prefix: str, *, cap: int = 10_000, top: int = 10,
    seen: FirstSeen | None = None,
) -> Overview:
    """Scan at most about ``cap`` keys under ``prefix`` (SCAN, pipelined reads)."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    soonest: list[tuple[int, str, Lock]] = []
    everyone: list[Lock] = []
    no_expiry = 0
    total = 0
    cursor = 0
    while True:
        cursor, locks = _scan_locks(client, prefix, None, cursor)
        for lock in locks:
            total += 1
            by_state = counts.setdefault((lock.task, lock.scope), dict.fromkeys(STATES, 0))
            by_state[lock.state] = by_state.get(lock.state, 0) + 1
            if lock.ttl_ms == -1:
                no_expiry += 1
            elif lock.ttl_ms >= 0:
                item = (-lock.ttl_ms, lock.key, lock)
                if len(soonest) < top:
                    heapq.heappush(soonest, item)
                else:
                    heapq.heappushpop(soonest, item)
            everyone.append(lock)
        if cursor == 0 or total >= cap:
            break
    first = seen.see(everyone) if seen is not None else {}
    oldest = heapq.nsmallest(
        top, ((lock, first.get(lock.key, 0.0)) for lock in everyone),
        key=lambda pair: (pair[1], pair[0].key),
    )
    return Overview(
        counts=dict(sorted(counts.items())),
        soonest=[lock for _, _, lock in sorted(soonest, reverse=True)],
        oldest=oldest,
        no_expiry=no_expiry,
        locks=total,
        complete=cursor == 0,
    )


def read_lock(client: redis.Redis, prefix: str, key: str) -> Lock | None:
    """The lock at ``key`` (value and TTL read atomically), or None when there is none."""
    if split_key(prefix, key) is None:
        return None
    pipe = client.pipeline(transaction=True)
    pipe.get(key_bytes(key))
    pipe.pttl(key_bytes(key))
    value, pttl = pipe.execute(raise_on_error=False)
    if isinstance(pttl, Exception) or pttl == -2:
        return None
    return to_lock(prefix, key, value, pttl, None)


def clear_lock(client: redis.Redis, prefix: str, key: str, owner: str) -> bool:
    """Delete the lock at ``key`` if ``owner`` still holds it (compare-and-delete in Lua: a
    successor's lock is never touched). True when it was deleted."""
    if split_key(prefix, key) is None or not owner:
        return False  # never a key outside the prefix (the app refuses it with a 400 first)
    return RedisStore(client).release(key_bytes(key), owner) is Outcome.OK  # type: ignore[arg-type]


# -- the counters over time --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """The flushed counters of every task at one moment (epoch seconds)."""

    time: float
    tasks: dict[str, TaskStats]


class StatsHistory:
    """A bounded time series of the stats hashes, sampled by this process.

    Every ``every`` seconds a daemon thread reads ``{prefix}:stats:*`` (SCAN and pipelined
    HGETALL, as ``taskdedup stats`` does) and keeps the latest ``keep`` samples: memory is
    bounded by ``keep`` times the number of tasks. The duplicate rate over an interval is
    ``Δduplicates / (Δaccepted + Δduplicates)`` between two samples.

    The thread starts with the first :meth:`ensure_started` (the first request), not at
    import or app creation, so an app mounted inside another one (whose lifespan events a
    mounted app does not get) samples too.
    """

    def __init__(
        self, client: redis.Redis, prefix: str, *, every: float = 10.0, keep: int = 360
    ) -> None:
        if every <= 0 or keep < 2:
            raise ValueError("StatsHistory needs every > 0 and keep >= 2")
        self.client = client
        self.prefix = prefix
        self.every = float(every)
        self.samples: deque[Sample] = deque(maxlen=keep)
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def sample(self) -> Sample | None:
        """Read the counters now and keep them; None (and :attr:`last_error`) on a failure."""
        try:
            tasks = read_stats(self.client, self.prefix)
        except Exception as exc:  # said on the page, never a silent stop of the chart
            self.last_error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            if not isinstance(exc, redis.RedisError):
                logger.exception("taskdedup web: stats sample failed")
            return None
        item = Sample(time.time(), tasks)
        with self._lock:
            self.samples.append(item)
        self.last_error = None
        return item

    def ensure_started(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="taskdedup-web-stats", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # the thread must outlive anything a sample meets
                logger.exception("taskdedup web: stats sample failed")
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        self._thread = None

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def rates(self, samples: Sequence[Sample] | None = None) -> dict[str, list[tuple[float,
                                                                               float | None]]]:
        """``{task: [(end of interval, duplicate rate or None), ...]}``, one point per
        interval between two consecutive samples; None when the task saw no enqueue in it
        (or its counters went backwards: the hash was deleted)."""
        samples = self.snapshot() if samples is None else samples
        out: dict[str, list[tuple[float, float | None]]] = {}
        for before, after in _pairs(samples):
            for task in sorted(set(before.tasks) | set(after.tasks)):
                old = before.tasks.get(task)
                new = after.tasks.get(task)
                rate: float | None = None
                if new is not None:
                    accepted = new.accepted - (old.accepted if old else 0)
                    duplicates = new.duplicates - (old.duplicates if old else 0)
                    if accepted >= 0 and duplicates >= 0 and accepted + duplicates > 0:
                        rate = duplicates / (accepted + duplicates)
                out.setdefault(task, []).append((after.time, rate))
        return out

    def window_deltas(self) -> dict[str, dict[str, int]]:
        """Per task, what the counters gained between the first and the last sample kept."""
        samples = self.snapshot()
        if len(samples) < 2:
            return {}
        first, last = samples[0], samples[-1]
        out = {}
        for task, new in last.tasks.items():
            old = first.tasks.get(task)
            out[task] = {
                name: max(0, getattr(new, name) - (getattr(old, name) if old else 0))
                for name in ("accepted", "duplicates", "lease_lost", "store_errors")
            }
        return out


def _pairs(samples: Sequence[Sample]) -> Iterator[tuple[Sample, Sample]]:
    for index in range(1, len(samples)):
        yield samples[index - 1], samples[index]
