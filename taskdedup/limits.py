"""Per-key concurrency and rate limits across workers (SPEC §16), framework-free.

:class:`Concurrency` and :class:`Rate` are declared on a task (``limits=[...]``) or an RQ
queue. A worker asks :func:`admit` right after the dedup claim (a duplicate never takes a
slot): every limit in one Lua call each, concurrency slots first, then rate starts; a limit
that refuses gives back what the call took before it, and the call is put off (republished
by the integration, not a retry, holding no worker slot) or, ``on_excess="drop"``, dropped.

Redis keys, one per limit and key value, under the store's prefix::

    {prefix}:limit:{task}:{index}{c|r}:{<digest>}

``c``: a ZSET of slot holders scored by lease expiry; ``r``: a ZSET of start times (a
sliding-window log); both on Redis's clock. The key value is never stored: only a digest of
it (:func:`taskdedup.identity.fingerprint_value`), which is also the key's hash tag (one
Cluster slot per limit and value). ``{prefix}:limit:{task}:w`` holds the calls waiting now
(a gauge for operators: ``taskdedup stats``, the dashboard, Prometheus).

Slots are leased like running locks and renewed every ``lease / 3`` by a heartbeat thread
(the core's :class:`~taskdedup.core.Heartbeat`, beating slots): a killed worker's slot frees
itself within ``lease``.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Protocol, cast, runtime_checkable

from .core import Heartbeat
from .events import Event, logger
from .exceptions import ConfigurationError, StoreUnavailableError, TaskDedupError
from .identity import fingerprint_value
from .stores.base import Outcome

if TYPE_CHECKING:
    from .core import Deduplicator

__all__ = [
    "LIMITED_SINCE",
    "refusal",
    "Admission",
    "Concurrency",
    "Limit",
    "LimitStats",
    "LimitStore",
    "OnLimit",
    "Rate",
    "RateLimitedError",
    "admit",
    "coerce_limits",
    "limit_delay",
    "limit_key",
    "limited_since",
    "read_limits",
    "summary",
    "release",
]

LIMITED_SINCE: Final = "taskdedup_limited"
"""Celery message header / RQ ``job.meta`` entry: the Unix time at which a call was first
put off by a limit (its backoff grows with the wait; never an argument value)."""

MIN_WAIT: Final = 0.2
"""Seconds: the shortest put-off of a call that found no free slot."""
MAX_WAIT: Final = 5.0
"""Seconds: the longest put-off of a call waiting for a concurrency slot (a slot frees
without notice; waiting calls look again at least this often)."""
_SEGMENT: Final = "limit"
_WAITING_SLACK_MS: Final = 30_000


class OnLimit(StrEnum):
    """What a call does when a limit is closed."""

    WAIT = "wait"
    """Put off (republished later, not a retry, holding no worker slot) until it fits."""
    DROP = "drop"
    """End at once, without running, in a state that says the limit dropped it."""


class RateLimitedError(TaskDedupError):
    """A call was dropped by a limit (``on_excess="drop"``): its body did not run.

    Attributes:
        task: the task name.
        limit: the limit that dropped it (``repr`` shows its figures, never a key value).
    """

    def __init__(self, task: str, limit: str, message: str | None = None) -> None:
        self.task = task
        self.limit = limit
        self.message = message or (
            f"{task} was dropped by its limit {limit} (on_excess='drop'): the body did not run")
        super().__init__(task, limit, self.message)  # rebuilt as cls(*args) (pickling)

    def __str__(self) -> str:
        return self.message


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{owner}: {name} must be an int >= 1, got {value!r}")
    return value


def _key_fn(owner: str, key: Any) -> Callable[..., Any] | None:
    if key is not None and not callable(key):
        raise ConfigurationError(
            f"{owner}: key must be a callable taking the task's arguments (or None: one "
            f"limit for the whole task), got {type(key).__name__}")
    return key  # type: ignore[no-any-return]


def _on(owner: str, name: str, value: Any) -> OnLimit:
    try:
        return OnLimit(value)
    except ValueError:
        raise ConfigurationError(
            f"{owner}: {name} must be one of {', '.join(repr(v.value) for v in OnLimit)}, "
            f"got {value!r}") from None


@dataclass(frozen=True, slots=True, init=False)
class Concurrency:
    """At most ``limit`` bodies of the task run at once across all workers, per value of
    ``key(*args, **kwargs)`` (None: one limit for the task).

    A call that finds no free slot waits (``on_busy="wait"``: put off and tried again,
    not a retry) or is dropped (``on_busy="drop"``). Slots are leased with the task's
    ``Policy.lease`` and heartbeated, so a killed worker's slot frees itself in a lease.

    Raises:
        ConfigurationError: ``limit < 1``, a non-callable ``key`` or an unknown ``on_busy``.
    """

    limit: int
    key: Callable[..., Any] | None
    on_busy: OnLimit

    def __init__(self, limit: int, *, key: Callable[..., Any] | None = None,
                 on_busy: OnLimit | str = OnLimit.WAIT) -> None:
        set_ = object.__setattr__
        set_(self, "limit", _positive_int("Concurrency", "limit", limit))
        set_(self, "key", _key_fn("Concurrency", key))
        set_(self, "on_busy", _on("Concurrency", "on_busy", on_busy))

    @property
    def drops(self) -> bool:
        return self.on_busy is OnLimit.DROP

    def __repr__(self) -> str:
        keyed = ", key=…" if self.key is not None else ""
        return f"Concurrency({self.limit}{keyed}, on_busy={self.on_busy.value!r})"


@dataclass(frozen=True, slots=True, init=False)
class Rate:
    """At most ``limit`` starts per ``per`` seconds across all workers, per value of
    ``key(*args, **kwargs)`` (a sliding window on Redis's clock). The first ``limit``
    calls are not held back; the excess waits for room (``on_excess="wait"``) or is
    dropped (``on_excess="drop"``: :class:`RateLimitedError`, counted as ``dropped``).

    Raises:
        ConfigurationError: ``limit < 1``, ``per <= 0``, a non-callable ``key`` or an
            unknown ``on_excess``.
    """

    limit: int
    per: float
    key: Callable[..., Any] | None
    on_excess: OnLimit

    def __init__(self, limit: int, per: float | timedelta, *,
                 key: Callable[..., Any] | None = None,
                 on_excess: OnLimit | str = OnLimit.WAIT) -> None:
        set_ = object.__setattr__
        set_(self, "limit", _positive_int("Rate", "limit", limit))
        seconds = per.total_seconds() if isinstance(per, timedelta) else per
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or seconds <= 0 or seconds * 1000 < 1):
            raise ConfigurationError(
                f"Rate: per must be a number of seconds (or a timedelta) of at least 1 ms, "
                f"got {per!r}")
        set_(self, "per", float(seconds))
        set_(self, "key", _key_fn("Rate", key))
        set_(self, "on_excess", _on("Rate", "on_excess", on_excess))

    @property
    def per_ms(self) -> int:
        return max(1, round(self.per * 1000))

    @property
    def drops(self) -> bool:
        return self.on_excess is OnLimit.DROP

    def __repr__(self) -> str:
        keyed = ", key=…" if self.key is not None else ""
        return (f"Rate({self.limit}, per={self.per:g}{keyed}, "
                f"on_excess={self.on_excess.value!r})")


Limit = Concurrency | Rate


def coerce_limits(value: Any, owner: str) -> tuple[Limit, ...]:
    """The declared ``limits=`` as a tuple (concurrency first, then rates, each in declared
    order); None or empty: no limits.

    Raises:
        ConfigurationError: anything but a Concurrency or Rate (or a list of them).
    """
    if value is None or value is False:
        return ()
    items = [value] if isinstance(value, (Concurrency, Rate)) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigurationError(
            f"{owner}: limits= takes a list of taskdedup.Concurrency / taskdedup.Rate, got "
            f"{type(value).__name__}")
    for item in items:
        if not isinstance(item, (Concurrency, Rate)):
            raise ConfigurationError(
                f"{owner}: limits= takes taskdedup.Concurrency and taskdedup.Rate, got "
                f"{type(item).__name__}")
    return tuple(sorted(items, key=lambda limit: 0 if isinstance(limit, Concurrency) else 1))


def limit_key(prefix: str, task: str, index: int, limit: Limit, args: Sequence[Any],
              kwargs: Mapping[str, Any] | None) -> str:
    """The Redis key of ``limit`` (the ``index``-th of ``task``) for this call's key value;
    only a digest of the value, never the value itself.

    Raises:
        TypeError: the key function failed on these arguments, or its value has no
            canonical form (a ``ConfigurationError`` would blame the declaration).
    """
    kind = "c" if isinstance(limit, Concurrency) else "r"
    if limit.key is None:
        value: Any = None
    else:
        try:
            value = limit.key(*args, **dict(kwargs or {}))
        except Exception as exc:
            raise TypeError(
                f"the key function of {task}'s {limit!r} failed on this call's arguments: "
                f"{type(exc).__name__}") from exc
    digest = fingerprint_value(f"{task}\x00{index}{kind}", value)
    return f"{prefix}:{_SEGMENT}:{task}:{index}{kind}:{{{digest}}}"


def waiting_key(prefix: str, task: str) -> str:
    """The ZSET of ``task``'s calls waiting now (call id -> when the wait is over, ms)."""
    return f"{prefix}:{_SEGMENT}:{task}:w"


@runtime_checkable
class LimitStore(Protocol):
    """What a store needs for limits (RedisStore and MemoryStore have it)."""

    def slot_acquire(self, key: str, holder: str, limit: int,
                     lease_ms: int) -> tuple[bool, int]: ...

    def slot_heartbeat(self, key: str, holder: str, lease_ms: int) -> Outcome: ...

    def slot_release(self, key: str, holder: str) -> Outcome: ...

    def rate_acquire(self, key: str, member: str, limit: int,
                     per_ms: int) -> tuple[bool, int]: ...


@dataclass(slots=True)
class Admission:
    """What :func:`admit` answered. ``ok``: the body runs, holding ``slots`` (give them
    back with :func:`release`). Else ``limit`` is the one that refused: ``dropped`` (its
    ``on_*="drop"``) or put off; ``wait_ms`` is how long until it might have room."""

    ok: bool
    slots: list[tuple[str, str]] = field(default_factory=list)
    limit: Limit | None = None
    wait_ms: int = 0
    dropped: bool = False


_HAS_SLOTS: dict[type, bool] = {}  # store class -> whether it is a LimitStore


def _store(dedup: Deduplicator) -> LimitStore:
    store = dedup.store
    kind = type(store)
    has = _HAS_SLOTS.get(kind)
    if has is None:  # a runtime Protocol check costs ~5 us: once per class, not per call
        has = _HAS_SLOTS[kind] = isinstance(store, LimitStore)
    if not has:
        raise ConfigurationError(
            f"limits need a store with slots (RedisStore or MemoryStore); "
            f"{type(store).__name__} has none")
    return cast("LimitStore", store)


def admit(dedup: Deduplicator, task: str, limits: Sequence[Limit], args: Sequence[Any],
          kwargs: Mapping[str, Any] | None, call_id: str, lease_ms: int, *,
          keys: Sequence[str] | None = None) -> Admission:
    """Take every limit of one execution of ``task`` (``call_id``: its task/job id), in
    order; a refusal gives back what was taken before it. Emits ``limited`` or
    ``dropped`` for a refused call. The slots taken are heartbeated until :func:`release`.
    ``keys``: the limits' keys when the caller derived them already (an RQ job carries them).

    Raises:
        TypeError: a key function failed on these arguments (the call cannot be placed).
        StoreUnavailableError: Redis could not be reached (nothing is held).
    """
    store = _store(dedup)
    taken: list[tuple[str, str]] = []
    holder = f"{call_id}~{uuid.uuid4().hex[:12]}"
    try:
        for index, limit in enumerate(limits):
            key = (keys[index] if keys is not None
                   else limit_key(dedup.prefix, task, index, limit, args, kwargs))
            if isinstance(limit, Concurrency):
                ok, figure = store.slot_acquire(key, holder, limit.limit, lease_ms)
            else:
                ok, figure = store.rate_acquire(key, holder, limit.limit, limit.per_ms)
            if not ok:
                _give_back(store, taken)
                dropped = limit.drops
                dedup._emit(Event.DROPPED if dropped else Event.LIMITED, task, key, call_id,
                            detail="concurrency" if isinstance(limit, Concurrency) else "rate")
                return Admission(False, [], limit, figure, dropped)
            taken.append((key, holder))
    except BaseException:
        _give_back(store, taken)
        raise
    beats = _slot_heartbeat(dedup)
    for (key, holder_id), limit in zip(taken, limits, strict=False):
        if isinstance(limit, Concurrency):
            beats.add(task, key, holder_id, lease_ms)
    return Admission(True, taken)


def release(dedup: Deduplicator, slots: Iterable[tuple[str, str]]) -> None:
    """Give back the concurrency slots of an execution whose body has ended (its rate
    starts stay: they happened). Sent at once and its reply read later where the store can
    (``slot_release_later``, like a worker's completion): the slot is free when the server
    reads it, and the worker's next task does not wait for the reply. Never raises; a slot
    not given back lapses in a lease."""
    beats = _slot_heartbeat(dedup)
    store = _store(dedup)
    later = getattr(store, "slot_release_later", None)
    for key, holder in slots:
        if not _is_slot(key):
            continue  # a rate's start: it counts for its window
        beats.remove(key, holder)
        try:
            if later is not None and later(key, holder, _not_given_back):
                # its reply read soon if no claim here reads it, by the slots' heartbeat
                # thread: running since the slot was taken (an RQ work-horse starts no other)
                beats.settle_soon(store)
            else:
                store.slot_release(key, holder)
        except Exception as exc:
            _not_given_back(exc)


def _not_given_back(outcome: Any) -> None:
    """The reply of a slot's release: only an error is worth a word."""
    if isinstance(outcome, Exception):  # it lapses within its lease
        logger.warning("taskdedup: could not give back a concurrency slot (%s); it frees "
                       "itself within the lease", outcome)


def _give_back(store: LimitStore, taken: Iterable[tuple[str, str]]) -> None:
    """Undo what a refused admission took (slots and starts alike): a call that did not
    start holds nothing and counts in no window."""
    for key, holder in taken:
        try:
            store.slot_release(key, holder)
        except Exception:  # a slot lapses within its lease; a start leaves its window
            logger.debug("taskdedup: could not give back a limit entry of a refused call")


def refusal(task: str, call_id: str, exc: StoreUnavailableError) -> ConfigurationError:
    """The error a call fails with when Redis refuses its limits for what they are (a
    missing ACL permission: the limit scripts need the sorted-set commands), not for an
    outage: putting it off again would fail the same way forever."""
    error = ConfigurationError(
        f"taskdedup: Redis refused the limits of {task}[{call_id}] ({exc.__cause__}); the "
        "store's user needs the sorted-set commands limits use (+zadd +zrem +zrange "
        "+zremrangebyscore +zcard +zscore +zcount): run `taskdedup doctor`")
    error.__cause__ = exc
    return error


def limit_delay(limit: Limit, wait_ms: int, waited: float, lease: float,
                redelivery: float | None = None) -> float:
    """Seconds to put a refused call off. A rate limit knows when its window has room
    (``wait_ms``); a concurrency slot frees without notice, so a waiting call looks again
    after a backoff that grows with its wait (a quarter of it), from :data:`MIN_WAIT` up to
    :data:`MAX_WAIT` and a quarter of the lease (a killed holder's slot lapses within the
    lease). A little jitter spreads the waiting calls; under half of ``redelivery`` (the
    broker's visibility timeout) so the broker never copies a waiting message."""
    if isinstance(limit, Rate):
        base = max(MIN_WAIT / 4, wait_ms / 1000)
        delay = base + random.uniform(0, min(0.25, base / 10))
    else:
        base = min(max(MIN_WAIT, waited / 4), max(MIN_WAIT, min(MAX_WAIT, lease / 4)))
        delay = base * random.uniform(0.8, 1.2)
    if redelivery is not None:
        delay = max(0.05, min(delay, redelivery / 2))
    return delay


def limited_since(value: Any) -> float | None:
    """The carried start of a limit wait, when it is a plausible Unix time (else None): the
    check of :func:`taskdedup.flow.waiting_since` (imported here, not at the top, so
    ``import taskdedup`` does not load the second call's scripts)."""
    from .flow import waiting_since

    return waiting_since(value)


def note_waiting(dedup: Deduplicator, task: str, call_id: str, delay: float | None) -> None:
    """Keep the operators' gauge of waiting calls (best effort, Redis only): ``delay``
    seconds more for a call put off, None for a call that got in (or ended)."""
    client = getattr(dedup.store, "client", None)
    if client is None:
        return
    key = waiting_key(dedup.prefix, task)
    try:
        if delay is None:
            client.zrem(key, call_id)
        else:
            until = int((time.time() + delay) * 1000) + _WAITING_SLACK_MS
            with client.pipeline(transaction=False) as pipe:
                pipe.zadd(key, {call_id: until})
                pipe.pexpire(key, _WAITING_SLACK_MS * 20)
                pipe.execute()
    except Exception as exc:  # a gauge: never fail a call for it
        logger.debug("taskdedup: could not update the waiting calls of %s: %s", task, exc)


# -- heartbeat of slots ---------------------------------------------------------------------


class SlotHeartbeat(Heartbeat):
    """The core's heartbeat thread, renewing this process's concurrency slots every
    ``lease / 3`` instead of running locks; a slot found lapsed is reported as
    ``lease_lost:slot`` and dropped from the set (the body keeps running)."""

    def _beat(self, name: str, key: str, owner: str, lease_ms: int) -> None:
        dedup = self._dedup
        try:
            outcome = _store(dedup).slot_heartbeat(key, owner, lease_ms)
        except StoreUnavailableError as exc:
            logger.warning("taskdedup: heartbeat of a %s slot failed: %s", name, exc)
            return
        except Exception:  # the thread must survive anything
            logger.exception("taskdedup: heartbeat of a %s slot failed", name)
            return
        if outcome is not Outcome.OK:
            self.remove(key, owner)
            call_id = owner.partition("~")[0]
            dedup._emit(Event.LEASE_LOST, name, key, call_id, detail="slot")
            logger.warning("taskdedup: %s[%s] lost its concurrency slot (it lapsed before the "
                           "heartbeat)", name, call_id)


_BEATS: dict[int, tuple[int, SlotHeartbeat]] = {}
_BEATS_LOCK = threading.Lock()


def _slot_heartbeat(dedup: Deduplicator) -> SlotHeartbeat:
    """This process's slot heartbeat for ``dedup`` (a new one after a fork)."""
    pid = os.getpid()
    with _BEATS_LOCK:
        held = _BEATS.get(id(dedup))
        if held is None or held[0] != pid:
            held = _BEATS[id(dedup)] = (pid, SlotHeartbeat(dedup))
        return held[1]


def _is_slot(key: str) -> bool:
    return key.rpartition(":{")[0].endswith("c")


# -- operators ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitStats:
    """Live figures of one task's limits, read from Redis (never per key value)."""

    task: str
    slots_in_use: int = 0
    waiting: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "slots_in_use": self.slots_in_use, "waiting": self.waiting}


def read_limits(client: Any, prefix: str = "taskdedup",
                task: str | None = None) -> dict[str, LimitStats]:
    """Slots in use and calls waiting per task, from Redis now (SCAN, then one pipelined
    ZCOUNT per key, on the server's clock).

    Raises:
        redis.RedisError: Redis could not be reached or refused a command.
    """
    from .locks import glob_escape, key_text

    head = f"{prefix}:{_SEGMENT}:"
    pattern = glob_escape(head + (task + ":" if task is not None else "")) + "*"
    keys = [key_text(k) for k in client.scan_iter(match=pattern, count=1000)]
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    slots: dict[str, int] = {}
    waiting: dict[str, int] = {}
    wanted: list[tuple[str, str, dict[str, int]]] = []
    for key in keys:
        rest = key[len(head):]
        if rest.endswith(":w"):
            wanted.append((key, rest[:-2], waiting))
        elif rest.endswith("}") and _is_slot(key):
            name = rest.rpartition(":{")[0].rpartition(":")[0]
            wanted.append((key, name, slots))
    out: dict[str, LimitStats] = {}
    if not wanted:
        return out
    with client.pipeline(transaction=False) as pipe:
        for key, _, _ in wanted:
            pipe.zcount(key, f"({now_ms}", "+inf")
        counts = pipe.execute(raise_on_error=False)
    for (_, name, into), count in zip(wanted, counts, strict=True):
        if isinstance(count, int):
            into[name] = into.get(name, 0) + count
    for name in sorted(set(slots) | set(waiting)):
        if task is None or name == task:
            out[name] = LimitStats(name, slots.get(name, 0), waiting.get(name, 0))
    return out


def summary(client: Any, prefix: str, stats: Mapping[str, Any],
            task: str | None = None) -> dict[str, dict[str, int]]:
    """Per task with limits: ``slots_in_use`` and ``waiting`` (live, :func:`read_limits`),
    ``limited`` (put off) and ``dropped`` (the counters in ``stats``:
    :func:`taskdedup.stats.read_stats` answers); what ``taskdedup stats``, the dashboard and
    its API show. Never per key value.

    Raises:
        redis.RedisError: Redis could not be reached or refused a command.
    """
    live = read_limits(client, prefix, task)
    counted = {name for name, item in stats.items()
               if item.get("limited") or item.get("dropped")}
    rows: dict[str, dict[str, int]] = {}
    for name in sorted(set(live) | counted):
        figures = live.get(name, LimitStats(name))
        item = stats.get(name)
        rows[name] = {
            "slots_in_use": figures.slots_in_use, "waiting": figures.waiting,
            "limited": item.get("limited") if item is not None else 0,
            "dropped": item.get("dropped") if item is not None else 0,
        }
    return rows
