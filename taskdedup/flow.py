"""What the second call gets beyond a skip (SPEC §15): wait, coalesce, debounce.

``on_busy="wait"``: an execution that finds another id running its identity is put off with
the same republish as a copy of a running message (:func:`taskdedup.core.copy_wait`), not
counted as a retry and holding no worker slot. When the wait started travels with the message
(a Celery header, an RQ job's meta: :data:`WAITING_SINCE`), never an argument value, so a
``busy_timeout`` is measured across republishes and workers. Framework-free: the integrations
ask :func:`busy_wait` and do the republish their own way.

``on_duplicate="coalesce"`` and ``debounce=``: a record beside the lock (the lock key is its
hash tag: one slot), moved with the lock in one Lua call each (``stores/lua/coalesce.lua``,
``follow_up.lua``, ``debounce.lua``, ``debounced.lua``; ``undo.lua`` after a failed
publish): :func:`coalesce` and :func:`debounce` at the publish, :func:`claim` at the
worker. A message carries its generation (:data:`GENERATION`, :data:`FOLLOW_UP`: a Celery
header field, an RQ meta field), never an argument value in Redis; a worker recognises a
superseded message by it alone, so a worker restarted without memory resurrects none.
RedisStore only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .core import COPY_WAIT_MIN, Deduplicator, GateResult, Identity, StartResult, Verdict
from .events import Event, logger
from .exceptions import ConfigurationError, StoreUnavailableError
from .policy import Policy
from .stores.base import LockState
from .stores.owners import owner_text
from .stores.redis import RedisStore
from .stores.redis import _result as _lock_result
from .stores.scripts import source as lua_source

__all__ = [
    "BUSY_TOLERANCE", "FOLLOW_UP", "GENERATION", "SUPERSEDED_MARK", "WAITING_SINCE", "Flow",
    "busy_wait", "claim", "coalesce", "coalesced", "debounce", "debounce_key", "follow_up_key",
    "generation_of", "superseded_of", "superseded_value", "undo", "waiting_since",
]

GENERATION: Final = "gen"
"""Field of the ``taskdedup`` message header (Celery) / ``job.meta["taskdedup"]`` (RQ): the
generation of a debounced call."""
FOLLOW_UP: Final = "next"
"""The same for a coalesced follow-up's message: the generation it was published with."""
SUPERSEDED_MARK: Final = "superseded"

WAITING_SINCE: Final = "taskdedup_waiting"
"""Celery message header / RQ ``job.meta`` entry: the Unix time (float seconds) at which the
call was first put off because its identity was busy."""

BUSY_TOLERANCE: Final = 0.05
"""Seconds: a call that comes back this close to its ``busy_timeout`` ends at once rather
than being put off for a few milliseconds more."""


def waiting_since(value: Any) -> float | None:
    """The carried start of a wait, when it is a plausible Unix time (else None: it starts
    now; a forged value can only shorten or restart the caller's own wait)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    since = float(value)
    if not math.isfinite(since) or since <= 0 or since > time.time() + 60:
        return None
    return since


def busy_wait(policy: Policy, waited: float, redelivery: float | None = None) -> float | None:
    """Seconds until a call that has ``waited`` seconds for a busy identity claims again, or
    None when its ``busy_timeout`` has passed (it ends in :class:`BusyTimeoutError`).

    The delay backs off with the time already waited (half of it: a short holder is followed
    closely, a long one is not polled), at least :data:`~taskdedup.core.COPY_WAIT_MIN`, at
    most a quarter of the lease (a killed holder's lock lapses within its lease: the waiters
    notice soon after), under half of ``redelivery`` (the broker's visibility timeout, so the
    broker does not copy the waiting message), and never past ``busy_timeout``: the last
    put-off lands on it, so the timeout is reported within a second or two of it.
    """
    wait = min(max(COPY_WAIT_MIN, waited / 2), max(COPY_WAIT_MIN, policy.lease / 4))
    if redelivery is not None:
        wait = max(0.1, min(wait, redelivery / 2))
    if policy.busy_timeout is not None:
        left = policy.busy_timeout - waited
        if left <= BUSY_TOLERANCE:
            return None
        wait = min(wait, left)
    return wait


# -- coalesce and debounce (SPEC §15) ------------------------------------------------------

_SOURCES = {name: lua_source(name, library=name in ("coalesce", "follow_up", "debounced"))
            for name in ("coalesce", "follow_up", "debounce", "debounced", "undo")}

_CODES = {1: Verdict.ACCEPTED, 7: Verdict.COALESCED, 8: Verdict.SUPERSEDED, 9: Verdict.WAITING}
_STATE = {s.value: s for s in LockState}


@dataclass(frozen=True, slots=True)
class Flow:
    """The publish's answer under coalesce: :class:`GateResult`'s fields and, for
    :attr:`Verdict.COALESCED`, the generation the follow-up's message carries."""

    verdict: Verdict
    existing_id: str | None = None
    state: LockState | None = None
    generation: int = 0


def follow_up_key(dedup: Deduplicator, key: str) -> str:
    """The follow-up record of lock ``key`` (same slot: ``key`` is its hash tag)."""
    return f"{dedup.prefix}:next:{{{key}}}"


def debounce_key(dedup: Deduplicator, key: str) -> str:
    """The debounce record of lock ``key`` (same slot)."""
    return f"{dedup.prefix}:debounce:{{{key}}}"


def generation_of(raw: Any, field: str) -> int | None:
    """The generation a message carries in ``field`` of its header/meta entry, if any."""
    if not isinstance(raw, Mapping):
        return None
    value = raw.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def superseded_value(generation: int) -> dict[str, Any]:
    """The result of a debounced call a later call of its burst superseded (Celery SUCCESS /
    RQ FINISHED, JSON-friendly; read it with :func:`superseded_of`)."""
    return {"SKIPPED": f"superseded by a later call of its burst (generation {generation})",
            "taskdedup": SUPERSEDED_MARK, "generation": generation}


def superseded_of(value: Any) -> dict[str, Any] | None:
    """``{"generation": n}`` when ``value`` is a superseded debounced call's result."""
    if isinstance(value, Mapping) and value.get("taskdedup") == SUPERSEDED_MARK:
        return {"generation": value.get("generation")}
    return None


def _store(dedup: Deduplicator, name: str) -> RedisStore:
    store = dedup.store
    if not isinstance(store, RedisStore):
        raise ConfigurationError(
            f"{name}: on_duplicate='coalesce' and debounce= keep their records in Redis; the "
            f"lock store here is {type(store).__name__} (use a RedisStore, or fakeredis[lua] "
            "in tests)")
    return store


def _run(dedup: Deduplicator, name: str, script: str, keys: list[str], *args: Any) -> Any:
    store = _store(dedup, name)
    registered = store.__dict__.get("_taskdedup_flow")
    if registered is None:
        registered = {k: store.client.register_script(v) for k, v in _SOURCES.items()}
        store.__dict__["_taskdedup_flow"] = registered
    return store._eval_keys(registered[script], script, keys, *args)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _owner(value: Any) -> str | None:
    """An owner in a script's reply, as the task id it names (either stored form)."""
    text = _text(value)
    return None if text is None else owner_text(text)


def _state(value: Any) -> LockState | None:
    text = _text(value)
    return _STATE.get(text) if text else None


def coalesce(
    dedup: Deduplicator, name: str, policy: Policy, identity: Identity, owner: str,
    ttl_ms: int, *, fresh: bool = False,
) -> Flow:
    """The enqueue gate of ``on_duplicate="coalesce"`` (one Lua call): ACCEPTED (reserved for
    ``owner``: publish as usual), DUPLICATE (a queued original, as ``return``), COALESCED
    (publish under ``existing_id``, the follow-up's id, carrying ``generation``) or, with the
    store down and ``on_store_error="allow"``, UNGUARDED.

    Raises:
        StoreUnavailableError: Redis is down and ``on_store_error='raise'``.
    """
    started = time.perf_counter()
    key = identity.key
    try:
        reply = _run(dedup, name, "coalesce", [key, follow_up_key(dedup, key)],
                     _store(dedup, name).stored_owner(owner), ttl_ms,
                     identity.check, "1" if fresh else "0")
    except StoreUnavailableError as exc:
        result = dedup.store_error(name, policy, key, owner, exc, "enqueue")
        return Flow(result.verdict)
    code = int(reply[0])
    if code != 7:
        answer: GateResult = dedup.verdict(name, identity, owner, _lock_result(reply[:3]),
                                           time.perf_counter() - started)
        return Flow(answer.verdict, answer.existing_id, answer.state)
    follow = _owner(reply[2]) or owner
    coalesced(dedup, name, key, owner, follow, int(reply[3]), time.perf_counter() - started)
    return Flow(Verdict.COALESCED, follow, _state(reply[1]) if _text(reply[1]) != "N" else None,
                int(reply[3]))


def coalesced(
    dedup: Deduplicator, name: str, key: str, owner: str, follow: str, generation: int,
    seconds: float | None = None,
) -> None:
    """Report a call folded into follow-up ``follow`` (``duplicate`` with the detail
    ``coalesced``: *coalesced* in ``taskdedup stats``); also for the fused publish, whose
    script answered it (:func:`taskdedup.stores.redis.reserve_and_run`)."""
    dedup._emit(Event.DUPLICATE, name, key, owner, follow, "coalesced", seconds)
    logger.debug("taskdedup: %s coalesced into follow-up %s (generation %d)", name, follow,
                 generation)


def debounce(dedup: Deduplicator, name: str, policy: Policy, key: str) -> tuple[int, float]:
    """The publish of a debounced call (one Lua call): ``(generation, countdown seconds)``;
    ``(0, wait)`` with the store down and ``on_store_error="allow"`` (every call then runs).

    Raises:
        StoreUnavailableError: Redis is down and ``on_store_error='raise'``.
    """
    bounce = policy.debounce
    assert bounce is not None
    try:
        generation, delay_ms = _run(dedup, name, "debounce", [debounce_key(dedup, key)],
                                    bounce.wait_ms, bounce.max_wait_ms, policy.ttl_ms)
    except StoreUnavailableError as exc:
        dedup.store_error(name, policy, key, "", exc, "enqueue")
        return 0, bounce.wait
    return int(generation), int(delay_ms) / 1000


def claim(
    dedup: Deduplicator, name: str, policy: Policy, key: str, owner: str, *,
    generation: int, follow_up: bool,
) -> StartResult:
    """The worker's claim of a debounced call (``follow_up`` False) or of a coalesced
    follow-up's message (True), with its generation (one Lua call): the verdicts of
    :meth:`Deduplicator.start`, plus SUPERSEDED (end without running) and WAITING for a run
    that must come after the one in progress (put off, as ``on_busy="wait"``).

    Raises:
        StoreUnavailableError: Redis is down and ``on_store_error='raise'``.
    """
    if not dedup._store_checked:
        dedup.check_store()
    try:
        if follow_up:
            reply = _run(dedup, name, "follow_up", [key, follow_up_key(dedup, key)],
                         _store(dedup, name).stored_owner(owner), policy.lease_ms, generation,
                         policy.ttl_ms)
        else:
            reply = _run(dedup, name, "debounced", [key, debounce_key(dedup, key)],
                         _store(dedup, name).stored_owner(owner), policy.lease_ms, generation)
    except StoreUnavailableError as exc:
        return dedup.store_error(name, policy, key, owner, exc, "start")
    code, state, holder = int(reply[0]), _state(reply[1]), _owner(reply[2])
    if code == 1:
        dedup._emit(Event.CLAIMED, name, key, owner)
        dedup.heartbeat().add(name, key, owner, policy.lease_ms)
        return StartResult(Verdict.ACCEPTED)
    if code == 8:
        if not follow_up:
            dedup._emit(Event.SKIPPED, name, key, owner, None, SUPERSEDED_MARK)
        logger.debug("taskdedup: %s[%s] generation %d was superseded: not run", name, owner,
                     generation)
        return StartResult(Verdict.SUPERSEDED)
    if code == 9:
        dedup._emit(Event.DEFERRED, name, key, owner, holder, "busy")
        return StartResult(Verdict.WAITING, holder, state)
    if holder == owner and state is LockState.RUNNING:
        dedup._emit(Event.DEFERRED, name, key, owner, owner, "copy")
        return StartResult(Verdict.DEFERRED, owner, state)
    if holder == owner:
        dedup._emit(Event.SKIPPED, name, key, owner, owner, state.value if state else "?")
        return StartResult(Verdict.FINISHED, owner, state)
    dedup._emit(Event.SKIPPED, name, key, owner, holder, state.value if state else "?")
    return StartResult(Verdict.DUPLICATE, holder, state)


def undo(dedup: Deduplicator, name: str, record: str, generation: int, *,
         created: bool = False) -> None:
    """Take back ``generation`` of ``record`` (:func:`follow_up_key` / :func:`debounce_key`)
    after the call it was given to could not be published (one Lua call, only if nothing
    moved it on since), so the follow-up's or the burst's earlier message is not superseded
    by one that was never sent. ``created``: that call's id became the follow-up. Best
    effort: never raises (the caller is raising the publish error)."""
    if not generation:
        return
    try:
        _run(dedup, name, "undo", [record], generation, "1" if created else "0")
    except Exception as exc:  # the store is down too: the record expires with its ttl
        logger.warning("taskdedup: %s: could not take back generation %d of %s after a failed "
                       "publish: %s", name, generation, record, exc)
