"""Counters kept in Redis without a round trip on the hot path.

A :class:`StatsRecorder` is a listener on :attr:`Deduplicator.events
<taskdedup.core.Deduplicator.events>`: each event only bumps a counter in process memory.
A daemon thread flushes the deltas every ``interval`` seconds (default 5), and once more at
interpreter exit, as one pipeline of ``HINCRBY`` into one hash per task::

    {prefix}:stats:{task}     e.g. taskdedup:stats:payments.charge

One key per task, so Redis Cluster spreads them over slots, and nothing lists the tasks in
a set that would pin one slot: readers find them with ``SCAN {prefix}:stats:*``
(:func:`read_stats`, ``taskdedup stats``). Fields:

* one per event: ``reserved``, ``duplicate``, ``claimed``, ``skipped``, ``completed``,
  ``released``, ``lease_lost``, ``store_error``;
* ``{event}:{detail}`` beside it when the event carries a detail, e.g. ``released:failed``,
  ``released:revoked``, ``duplicate:replaced``, ``skipped:running``, ``store_error:enqueue``;
* gate latency (``DedupEvent.seconds``): ``gate:count``, ``gate:sum_us`` (microseconds)
  and cumulative buckets ``gate:le_1ms`` … ``gate:le_1000ms`` (Prometheus-style).

No argument value is ever recorded: the fields come from the task name, the event and its
detail (a word chosen by taskdedup). A failed flush is logged at WARNING and its deltas are
kept for the next one; a flush cut mid-pipeline may count the sent part twice (counters are
statistics, not a ledger). After a fork the child starts from zero and runs its own thread:
the parent's pending deltas stay the parent's to flush.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import json
import os
import re
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import redis

from .events import FOLD_AT, DedupEvent, Event, Fields, logger
from .exceptions import ConfigurationError
from .locks import glob_escape, key_bytes, key_text
from .pids import _PID, pid
from .stores.redis import RedisStore, describe_client

if TYPE_CHECKING:
    from .core import Deduplicator

__all__ = [
    "DEFAULT_INTERVAL",
    "FAILURE_REASONS",
    "GATE_BUCKETS_MS",
    "StatsRecorder",
    "TaskStats",
    "attach",
    "flush_all",
    "flush_before_exit",
    "hand_over",
    "held_interval",
    "hold_threads",
    "read_stats",
    "release_threads",
    "stats_key",
    "take_over",
]

DEFAULT_INTERVAL: Final = 5.0
"""Seconds between two flushes of a process's deltas."""

GATE_BUCKETS_MS: Final = (1, 5, 25, 100, 1000)
"""Upper bounds (milliseconds) of the cumulative gate latency buckets ``gate:le_{b}ms``."""

FAILURE_REASONS: Final = frozenset({"failed", "rejected"})
"""``released`` details that count as "released on failure" (final failure, ``Reject``)."""

_STATS_SEGMENT: Final = "stats"
_READ_BATCH: Final = 500
_WARN_EVERY: Final = 60.0
# Details are words chosen by taskdedup; anything else is not recorded as its own field,
# so a surprising detail can never grow a hash without bound.
_DETAIL: Final = re.compile(r"[a-z0-9_.:-]{1,40}")
_SKIPPED_STATES: Final = {"Q": "queued", "R": "running", "D": "done", "F": "finished"}
_GATE_FIELDS: Final = tuple(f"gate:le_{bound}ms" for bound in GATE_BUCKETS_MS)
_GATE_BOUNDS_US: Final = tuple(bound * 1000 for bound in GATE_BUCKETS_MS)
_INTEGER: Final = re.compile(rb"-?[0-9]{1,19}")


def stats_key(prefix: str, task: str) -> str:
    """The hash holding the counters of ``task``: ``{prefix}:stats:{task}``."""
    return f"{prefix}:{_STATS_SEGMENT}:{task}"


def event_fields(event: DedupEvent) -> list[tuple[str, int]]:
    """The ``(field, increment)`` pairs one event adds to its task's hash."""
    micros = _micros(event.seconds)
    fields = [(name, 1) for name in _names(event.event, event.detail, _bucket(micros))]
    if micros >= 0:
        fields.append(("gate:sum_us", micros))
    return fields


def _micros(seconds: float | None) -> int:
    """Gate latency in microseconds, or -1 when the event carries none."""
    if isinstance(seconds, (int, float)) and seconds >= 0:
        return round(seconds * 1_000_000)
    return -1


def _bucket(micros: int) -> int:
    """The first gate bucket ``micros`` falls in (len: above all; -1: no latency)."""
    return bisect.bisect_left(_GATE_BOUNDS_US, micros) if micros >= 0 else -1


@functools.lru_cache(maxsize=1024)
def _names(event: Event, detail: str | None, bucket: int) -> tuple[str, ...]:
    """The fields an event adds 1 to (the gate's sum aside): the event, its detail, and
    for a measured one (``bucket`` ≥ 0) the gate count and the cumulative buckets."""
    name = event.value
    names = [name]
    if detail:
        if event is Event.SKIPPED:
            detail = _SKIPPED_STATES.get(detail, detail)
        if _DETAIL.fullmatch(detail):
            names.append(f"{name}:{detail}")
    if bucket >= 0:
        names.append("gate:count")
        names.extend(_GATE_FIELDS[bucket:])
    return tuple(names)


# Every live recorder, for the fork and exit hooks (weak: a dropped recorder just goes away).
_RECORDERS: weakref.WeakSet[StatsRecorder] = weakref.WeakSet()
# Deduplicator → its recorder, so attach() is idempotent.
_ATTACHED: weakref.WeakKeyDictionary[Any, StatsRecorder] = weakref.WeakKeyDictionary()
# The process whose recorders wait to start their flush thread (hold_threads), else 0.
_held_pid = 0


class StatsRecorder:
    """Counts events per (task, field) in memory and flushes them to Redis from a thread.

    The listener call appends the event's fields to a queue (no lock, no I/O on the task's
    path); they are counted in batches. The flush thread starts with the first event of each
    process (a new one after a fork).

    Args:
        client: the Redis client to write to (usually the store's).
        prefix: the key prefix of the Deduplicator (``{prefix}:stats:{task}``).
        interval: seconds between flushes.

    Example::

        recorder = StatsRecorder(redis.Redis(), interval=5)
        dedup.events.add(recorder)
    """

    def __init__(
        self, client: redis.Redis, *, prefix: str = "taskdedup", interval: float = DEFAULT_INTERVAL
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise ConfigurationError(
                f"stats interval must be a positive number of seconds, got {interval!r}"
            )
        self.client = client
        self.prefix = prefix
        self.interval = float(interval)
        self._init_process_state()
        _RECORDERS.add(self)

    def _init_process_state(self) -> None:
        """Fresh locks, no deltas, no thread: at construction and in a forked child."""
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._pending: dict[str, Counter[str]] = {}
        self._raw: deque[Fields] = deque()  # events not counted yet (_fold)
        self._pid = pid()
        self._thread: threading.Thread | None = None
        self._wanted = False  # a thread was due while held (hold_threads)
        self._stop = threading.Event()
        self._failing_since: float | None = None
        self._last_warning = 0.0

    # -- the listener (hot path) ----------------------------------------------------------

    def __call__(self, event: DedupEvent) -> None:
        self.tally((event.event, event.task, event.key, event.task_id, event.existing_id,
                    event.detail, event.seconds))

    def tally(self, fields: Fields) -> None:
        """Keep one event's fields (:meth:`~taskdedup.events.Events.record`)."""
        # The hot path only keeps the fields; they are counted in batches, by the flush or
        # every FOLD_AT events: a publish or a task pays an append (to a deque: no lock; the
        # fold takes each event out once), not the dozen counter updates a measured gate
        # makes.
        raw = self._raw
        raw.append(fields)
        if len(raw) >= FOLD_AT:
            with self._lock:
                self._fold()
        if self._pid != _PID[0] or self._thread is None:
            self._start_thread()

    def _fold(self) -> None:
        """Count the kept events into the pending deltas (under ``_lock``)."""
        # as many as are there now; one appended meanwhile waits for the next fold
        take = self._raw.popleft
        raw: list[Fields] = [take() for _ in range(len(self._raw))]
        sums: Counter[str] = Counter()
        kinds: Counter[tuple[str, Event, str | None, int]] = Counter()
        # most events carry no latency (a worker's): counted in one C pass
        unmeasured = [(task, kind, detail) for kind, task, _, _, _, detail, seconds in raw
                      if seconds is None]
        slow: list[tuple[str, Event, str | None, Any]]
        try:
            counted = Counter(unmeasured)
            slow = []
        except TypeError:  # an unhashable detail: each counted on its own, below
            counted, slow = Counter(), [(*event, None) for event in unmeasured]
        for (task, kind, detail), n in counted.items():
            kinds[task, kind, detail, -1] += n
        if len(unmeasured) < len(raw):
            slow += [(task, kind, detail, seconds)
                     for kind, task, _, _, _, detail, seconds in raw if seconds is not None]
        for task, kind, detail, seconds in slow:
            try:
                micros = _micros(seconds)
                kinds[task, kind, detail, _bucket(micros)] += 1
            except Exception:  # a malformed event (not one the core emits) is not counted
                logger.debug("taskdedup: stats left out a malformed event", exc_info=True)
                continue
            if micros >= 0:
                sums[task] += micros
        pending = self._pending
        for (task, kind, detail, bucket), n in kinds.items():
            counts = pending.get(task)
            if counts is None:
                counts = pending[task] = Counter()
            for name in _names(kind, detail, bucket):
                counts[name] += n
        for task, micros in sums.items():
            pending[task]["gate:sum_us"] += micros

    def _take(self) -> dict[str, Counter[str]]:
        """The pending deltas, taken out (under ``_lock``)."""
        self._fold()
        batch, self._pending = self._pending, {}
        return batch

    def pending(self) -> dict[str, dict[str, int]]:
        """The deltas not flushed yet, ``{task: {field: n}}`` (a copy)."""
        with self._lock:
            self._fold()
            return {task: dict(counts) for task, counts in self._pending.items() if counts}

    # -- flushing -------------------------------------------------------------------------

    def flush(self) -> bool:
        """Write the pending deltas with one pipeline; True when nothing is left pending.

        Never raises: an error is logged at WARNING (at most once a minute while it lasts)
        and the deltas that were not written are kept for the next flush.
        """
        failed, _, error = self._write(keep=True)
        if failed:
            self._warn(failed, error)
            return False
        if self._failing_since is not None:
            logger.info("taskdedup: stats flushed again to %s", describe_client(self.client))
            self._failing_since = None
        return True

    def _write(self, *, keep: bool) -> tuple[int, int, BaseException | None]:
        """One pipeline of HINCRBYs for what is pending. Returns the deltas and the counts
        not written, and why; those deltas are kept for the next flush when ``keep``."""
        if self._pid != pid():  # forked and not called since: the deltas were the parent's
            self._reset_after_fork()
        with self._flush_lock:
            with self._lock:
                batch = self._take()
            entries = [
                (task, name, n) for task, counts in batch.items() for name, n in counts.items() if n
            ]
            if not entries:
                return 0, 0, None
            failed: list[tuple[str, str, int]] = []
            error: BaseException | None = None
            try:
                pipe = self.client.pipeline(transaction=False)
                for task, name, n in entries:
                    pipe.hincrby(stats_key(self.prefix, task), name, n)
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:  # connection refused, timeout, ...: keep everything
                failed, error = entries, exc
            else:
                for entry, reply in zip(entries, replies, strict=True):
                    if isinstance(reply, Exception):
                        failed.append(entry)
                        error = reply
            if failed and keep:
                self._restore(failed)
            return len(failed), sum(n for _, _, n in failed), error

    def _restore(self, entries: Iterable[tuple[str, str, int]]) -> None:
        with self._lock:
            for task, name, n in entries:
                counts = self._pending.get(task)
                if counts is None:
                    counts = self._pending[task] = Counter()
                counts[name] += n

    def _warn(self, count: int, error: BaseException | None) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._last_warning < _WARN_EVERY:
            return  # still failing: one warning a minute is enough
        self._last_warning = now
        logger.warning(
            "taskdedup: could not flush stats to Redis at %s (%s: %s); keeping %d deltas "
            "for the next flush",
            describe_client(self.client), type(error).__name__, error, count,
        )

    # -- the thread -----------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._pid != pid():
            self._reset_after_fork()
        with self._lock:
            if self._thread is not None:
                return
            if _held_pid == self._pid:  # release_threads starts it
                self._wanted = True
                return
            self._thread = threading.Thread(
                target=_flush_loop,
                args=(weakref.ref(self), self._stop, self.interval),
                name="taskdedup-stats",
                daemon=True,
            )
            self._thread.start()

    def _reset_after_fork(self) -> None:
        # Locks copied by fork may be held by a thread that does not exist here.
        self._init_process_state()

    def close(self, *, flush: bool = True) -> bool:
        """Stop the flush thread and (by default) flush what is pending; True if all written."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)  # mid-flush at worst; never hold an exit for long
        self._thread = None
        self._stop = threading.Event()
        return self.flush() if flush else True


def _flush_loop(ref: weakref.ref[StatsRecorder], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        recorder = ref()
        if recorder is None:
            return
        try:
            recorder.flush()
        except Exception:  # the thread must survive anything
            logger.exception("taskdedup: stats flush failed")
        del recorder


def hold_threads() -> None:
    """This process's recorders do not start their flush thread until
    :func:`release_threads`; their deltas wait in memory meanwhile.

    For a process that usually ends before its first flush is due, as an RQ work-horse
    does: its deltas go to the parent at its end (:func:`hand_over`), and the thread it would
    have started per job (a thread start costs a forked child ~0.2-0.5 ms) is left out. A
    work-horse that claimed its lock itself releases them after :func:`held_interval`, from
    the heartbeat thread it runs anyway; one whose worker claimed for it releases them once
    claimed, so only a body that records something starts the thread, and holds them again
    once the body is over. Either way a long job's counts reach Redis on the same cadence.
    """
    global _held_pid
    _held_pid = pid()


def held_interval() -> float:
    """The shortest flush interval of this process's recorders (when the first flush of a
    thread started now would have been due)."""
    current = pid()
    return min((r.interval for r in list(_RECORDERS) if r._pid == current),
               default=DEFAULT_INTERVAL)


def release_threads(*, flush: bool = False) -> None:
    """End :func:`hold_threads`: the recorders that wanted their flush thread start it now.
    ``flush``: ``held_interval()`` has passed since the hold, so a recorder whose interval
    is that short writes its deltas first, as its thread would have by now."""
    global _held_pid
    current = pid()
    if _held_pid != current:
        return
    _held_pid = 0
    shortest = held_interval()
    for recorder in list(_RECORDERS):
        if recorder._pid != current:
            continue
        with recorder._lock:
            wanted, recorder._wanted = recorder._wanted, False
        if not wanted:
            continue
        if flush and recorder.interval <= shortest:
            recorder.flush()
        recorder._start_thread()


def _after_fork_in_child() -> None:
    for recorder in list(_RECORDERS):
        recorder._reset_after_fork()


def flush_all() -> bool:
    """Flush every recorder of this process now; True when nothing is left pending.

    For processes that end without running ``atexit`` handlers (a Celery pool child exits
    with ``os._exit``): call it from ``worker_process_shutdown``. Never raises.
    """
    ok = True
    for recorder in list(_RECORDERS):
        if recorder._pid == pid():
            ok = recorder.flush() and ok
    return ok


def hand_over(limit: int = 32_768) -> bytes | None:
    """Take this process's pending deltas out, encoded for the parent process (:func:`take_over`).

    For a process that ends right after one piece of work, as an RQ work-horse does: handing
    its counts to the long-lived parent over a pipe costs no Redis round trip. Recorders are
    named by ``id()``, which is the same in a forked child as in its parent. Returns None,
    and takes nothing, when the encoded deltas exceed ``limit`` bytes (a pipe that nobody
    reads yet must not fill up): flush them instead.
    """
    taken: list[tuple[StatsRecorder, dict[str, Counter[str]]]] = []
    for recorder in list(_RECORDERS):
        if recorder._pid == pid():
            with recorder._lock:
                batch = recorder._take()
            taken.append((recorder, batch))
    entries = [
        [id(recorder), task, name, n]
        for recorder, batch in taken for task, counts in batch.items()
        for name, n in counts.items() if n
    ]
    payload = json.dumps(entries, separators=(",", ":")).encode()
    if len(payload) <= limit:
        return payload
    for recorder, batch in taken:  # too much for the pipe: give it back
        recorder._restore((task, name, n) for task, counts in batch.items()
                          for name, n in counts.items())
    return None


def take_over(payload: bytes) -> bool:
    """Add deltas handed over by a forked child (:func:`hand_over`) to this process's
    recorders; they go out with this process's next flush. True when every entry found its
    recorder (one created in the child after the fork has no counterpart here). Never raises
    for a malformed payload: it is logged and dropped (counters are statistics)."""
    by_id = {id(recorder): recorder for recorder in _RECORDERS if recorder._pid == pid()}
    try:
        entries = [(int(r), str(t), str(f), int(n)) for r, t, f, n in json.loads(payload)]
    except (ValueError, TypeError) as exc:
        logger.warning("taskdedup: dropped unreadable stats from a child process: %s", exc)
        return False
    complete = True
    for recorder_id, task, name, n in entries:
        recorder = by_id.get(recorder_id)
        if recorder is None:
            complete = False
            continue
        recorder._restore([(task, name, n)])
        if recorder._thread is None:
            recorder._start_thread()
    return complete


def flush_before_exit() -> None:
    """The last flush of a process that is ending (``atexit``, a Celery pool child, an RQ
    work-horse). Never raises, and says one WARNING only when counts are really lost: the
    deltas that Redis did not take are dropped with the process, never kept "for later"."""
    lost = 0
    where, error = "", None
    for recorder in list(_RECORDERS):
        if recorder._pid != pid():
            continue
        try:
            recorder.close(flush=False)
            _, counts, reason = recorder._write(keep=False)
        except Exception:  # never in the way of an exit
            continue
        if counts:
            lost += counts
            where, error = describe_client(recorder.client), reason
    if lost:
        logger.warning(
            "taskdedup: %d stats counts lost as this process exits: Redis at %s did not take "
            "them (%s: %s)", lost, where, type(error).__name__, error,
        )


os.register_at_fork(after_in_child=_after_fork_in_child)
_exit_hook_registered = False


def attach(
    dedup: Deduplicator,
    *,
    client: redis.Redis | None = None,
    interval: float = DEFAULT_INTERVAL,
) -> StatsRecorder | None:
    """Record ``dedup``'s events in Redis; returns its recorder (the same one if called again).

    ``client`` defaults to the client of ``dedup.store`` when it is a
    :class:`~taskdedup.stores.RedisStore`; for another store (``MemoryStore``) without a
    client there is nowhere to write, and None is returned.
    """
    recorder = _ATTACHED.get(dedup)
    if recorder is not None:
        return recorder
    if client is None:
        store = dedup.store
        if not isinstance(store, RedisStore):
            return None
        client = store.client
    global _exit_hook_registered
    if not _exit_hook_registered:
        # Registered on first use, not at import: atexit runs last-in first-out, so the last
        # flush happens before the exit handlers of whatever was set up earlier (a server).
        atexit.register(flush_before_exit)
        _exit_hook_registered = True
    recorder = StatsRecorder(client, prefix=dedup.prefix, interval=interval)
    dedup.events.add(recorder)
    _ATTACHED[dedup] = recorder
    return recorder


# -- reading ----------------------------------------------------------------------------------


AGAIN: Final = ("retry", "repeat", "limit")
"""``reserved`` details of an accepted call's own id reserving again: not new enqueues."""


@dataclass(frozen=True, slots=True)
class TaskStats:
    """The flushed counters of one task, with the figures an operator asks for."""

    task: str
    fields: Mapping[str, int] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    """Fields of the hash that do not hold an integer (written by someone else): skipped."""

    def get(self, name: str) -> int:
        return self.fields.get(name, 0)

    @property
    def accepted(self) -> int:
        """Enqueues accepted (``reserved``), not counting an accepted call's own id reserving
        again for its retry, its ``Repeat`` or a limit's put-off (:data:`AGAIN`)."""
        return self.get("reserved") - sum(self.get(f"reserved:{why}") for why in AGAIN)

    @property
    def retries(self) -> int:
        """Retries of accepted calls that kept their lock for the retry (``reserved:retry``):
        Celery's ``self.retry``, RQ's ``Retry``."""
        return self.get("reserved:retry")

    @property
    def duplicates(self) -> int:
        """Enqueues found to be duplicates."""
        return self.get("duplicate")

    @property
    def skipped(self) -> int:
        """Executions skipped because another id held (or had done) the identity."""
        return self.get("skipped")

    @property
    def waits(self) -> int:
        """Executions put off because another id ran their identity (``on_busy="wait"``):
        one per put-off, so a call that waited three times counts three."""
        return self.get("deferred:busy")

    @property
    def coalesced(self) -> int:
        """Calls of a running identity folded into its one follow-up
        (``on_duplicate="coalesce"``)."""
        return self.get("duplicate:coalesced")

    @property
    def superseded(self) -> int:
        """Debounced calls that ended without running: a later call of their burst won."""
        return self.get("skipped:superseded")

    @property
    def second_calls(self) -> dict[str, int]:
        """``{"waits", "coalesced", "superseded"}`` (SPEC §15)."""
        return {"waits": self.waits, "coalesced": self.coalesced,
                "superseded": self.superseded}

    @property
    def released_on_failure(self) -> int:
        """Locks released after a final failure (see :data:`FAILURE_REASONS`)."""
        return sum(self.get(f"released:{reason}") for reason in FAILURE_REASONS)

    @property
    def lease_lost(self) -> int:
        return self.get("lease_lost")

    @property
    def store_errors(self) -> int:
        return self.get("store_error")

    @property
    def duplicate_rate(self) -> float | None:
        """``duplicates / (accepted + duplicates)``; None before any enqueue."""
        total = self.accepted + self.duplicates
        return self.duplicates / total if total else None

    @property
    def gate_count(self) -> int:
        return self.get("gate:count")

    @property
    def gate_avg_ms(self) -> float | None:
        """Mean gate latency in milliseconds; None when nothing was measured."""
        count = self.gate_count
        return self.get("gate:sum_us") / count / 1000 if count else None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: the operator figures, the gate latency and every raw field."""
        return {
            "task": self.task,
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "duplicate_rate": self.duplicate_rate,
            "retries": self.retries,
            "skipped": self.skipped,
            "completed": self.get("completed"),
            "waits": self.waits,
            "coalesced": self.coalesced,
            "superseded": self.superseded,
            "released_on_failure": self.released_on_failure,
            "lease_lost": self.lease_lost,
            "store_errors": self.store_errors,
            "gate": {
                "count": self.gate_count,
                "avg_ms": self.gate_avg_ms,
                "le_ms": {str(b): self.get(f"gate:le_{b}ms") for b in GATE_BUCKETS_MS},
            },
            "fields": dict(sorted(self.fields.items())),
            "ignored_fields": list(self.ignored),
        }


def read_stats(
    client: redis.Redis, prefix: str = "taskdedup", task: str | None = None
) -> dict[str, TaskStats]:
    """The flushed counters per task, found with SCAN (never KEYS), read in pipelines.

    With ``task``, only that task's hash is read. Keys under ``{prefix}:stats:`` that are not
    hashes (a lock of a task named ``stats``) are skipped, and so are fields that do not hold
    an integer (named in :attr:`TaskStats.ignored`): someone else's writes never hide the
    other counters. Undecodable bytes in names are kept (``surrogateescape``).

    Raises:
        redis.RedisError: Redis could not be reached or refused a command.
    """
    head = stats_key(prefix, "")
    if task is not None:
        keys: Iterable[Any] = [stats_key(prefix, task)]
    else:
        keys = client.scan_iter(match=glob_escape(head) + "*", count=1000)
    out: dict[str, TaskStats] = {}
    batch: list[str] = []

    def read(batch: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.hgetall(key_bytes(key))
        for key, reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                if str(reply).startswith("WRONGTYPE"):
                    continue  # not a stats hash
                raise reply
            if not reply:
                continue  # gone since the SCAN
            fields: dict[str, int] = {}
            ignored: list[str] = []
            for raw_name, raw_value in reply.items():
                value = raw_value.encode() if isinstance(raw_value, str) else raw_value
                if _INTEGER.fullmatch(value):
                    fields[key_text(raw_name)] = int(value)
                else:
                    ignored.append(key_text(raw_name))
            name = key[len(head):]
            out[name] = TaskStats(name, fields, tuple(sorted(ignored)))

    for key in keys:
        batch.append(key_text(key))
        if len(batch) >= _READ_BATCH:
            read(batch)
            batch = []
    if batch:
        read(batch)
    return dict(sorted(out.items()))


# -- approximate windows (SPEC §12) -------------------------------------------------------------

# One slice key: its length, the set bits of its m-bit filter and its tail (identities added,
# k, slices, the first index counted) and PTTL; read-only, one key (Cluster-safe).
_WINDOW_READ: Final = """
local n = redis.call('STRLEN', KEYS[1])
if n < 15 then return false end
local m = (n - 14) * 8
local tail = redis.call('BITFIELD', KEYS[1], 'GET', 'u32', m, 'GET', 'u8', m + 32,
                        'GET', 'u8', m + 40, 'GET', 'i64', m + 48)
return {m, redis.call('BITCOUNT', KEYS[1], 0, n - 15), tail[1], tail[2], tail[3], tail[4],
        redis.call('PTTL', KEYS[1])}
"""


@dataclass(frozen=True)
class WindowStats:
    """Quality signals of one task's approximate window, read from its live slices.

    ``fill`` is the mean share of set bits over the live slice keys (``fill_max`` the
    fullest); ``false_positive_rate`` the estimated chance that a new identity is taken for
    a duplicate now (per partition ``1 - prod(1 - fill ** k)`` over its live slices, averaged
    over partitions); ``identities`` the identities the live slices hold (their counters;
    a success with an explicit ``dedup_key`` counts two: the key and its arguments' pair);
    ``slices_dropped`` the slice periods rotated out of the window since the oldest slice
    still counted (per partition, the most).
    """

    task: str
    keys: int
    slices: int
    partitions: int
    hashes: int
    bits: int
    fill: float
    fill_max: float
    false_positive_rate: float
    identities: int
    slices_dropped: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "keys": self.keys, "live_slices": self.slices, "partitions": self.partitions,
            "hashes": self.hashes, "bits_per_key": self.bits, "fill_ratio": self.fill,
            "fill_ratio_max": self.fill_max,
            "estimated_false_positive_rate": self.false_positive_rate,
            "identities": self.identities, "slices_dropped": self.slices_dropped,
        }


def _window_task(prefix: str, key: str) -> tuple[str, int, int] | None:
    """``(task, partition, slice index)`` of slice key
    ``{prefix}:bloom:[{scope}:]{task}:{{tag}.{partition}}:{index}``."""
    head = f"{prefix}:bloom:"
    if not key.startswith(head):
        return None
    rest = key[len(head):]
    opening = rest.rfind(":{")
    closing = rest.find("}:", opening)
    if opening <= 0 or closing < 0:
        return None
    _, dot, partition = rest[opening + 2 : closing].rpartition(".")
    index = rest[closing + 2 :]
    if not dot or not partition.isdigit() or not index.lstrip("-").isdigit():
        return None
    return rest[:opening], int(partition), int(index)


def read_windows(
    client: Any, prefix: str = "taskdedup", task: str | None = None
) -> dict[str, WindowStats]:
    """The approximate windows' quality signals per task (``scope:task`` when scoped), from
    their slice keys found with SCAN (never KEYS) and read by a script per key, pipelined.

    Raises:
        redis.RedisError: Redis could not be reached or refused a command.
    """
    pattern = f"{glob_escape(prefix)}:bloom:"
    pattern += f"*{glob_escape(task)}:{{*" if task is not None else "*"
    keys = [key_text(k) for k in client.scan_iter(match=pattern, count=1000)]
    slices: dict[str, list[tuple[int, int, list[int]]]] = {}
    for start in range(0, len(keys), _READ_BATCH):
        batch = keys[start : start + _READ_BATCH]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.eval(_WINDOW_READ, 1, key_bytes(key))
        for key, reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            parsed = _window_task(prefix, key)
            if isinstance(reply, Exception):
                if str(reply).startswith("WRONGTYPE"):
                    continue
                raise reply
            if parsed is None or not reply:
                continue
            name, partition, index = parsed
            if task is not None and name != task and not name.endswith(":" + task):
                continue
            slices.setdefault(name, []).append((partition, index, [int(x) for x in reply]))
    out: dict[str, WindowStats] = {}
    for name, entries in slices.items():
        by_partition: dict[int, list[tuple[int, list[int]]]] = {}
        for partition, index, reply in entries:
            by_partition.setdefault(partition, []).append((index, reply))
        fills = [reply[1] / reply[0] for _, _, reply in entries]
        k = max(reply[3] for _, _, reply in entries) or 1
        fprs = []
        dropped = 0
        for rows in by_partition.values():
            miss = 1.0
            for _, reply in rows:
                miss *= 1 - (reply[1] / reply[0]) ** k
            fprs.append(1 - miss)
            newest, newest_reply = max(rows)
            dropped = max(dropped, newest - newest_reply[4] - newest_reply[5])
        out[name] = WindowStats(
            task=name, keys=len(entries),
            slices=len({index for _, index, _ in entries}),
            partitions=len(by_partition), hashes=k, bits=max(r[0] for _, _, r in entries),
            fill=sum(fills) / len(fills), fill_max=max(fills),
            false_positive_rate=sum(fprs) / len(fprs),
            identities=sum(reply[2] for _, _, reply in entries), slices_dropped=max(0, dropped),
        )
    return dict(sorted(out.items()))
