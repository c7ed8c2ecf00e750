"""The store contract: the lock state machine over any backend.

One key per task identity. Its value records a state (:class:`LockState`), the owner task
id (the fencing token) and, for explicit idempotency keys, a digest of the arguments
(``check``) so that reusing the key with other arguments is detected. Every transition is
one atomic call that compares the owner before it writes.

Durations are integer milliseconds here (``ttl_ms``/``lease_ms``); the public API converts.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["SETTLE_AFTER", "LockInfo", "LockResult", "LockState", "Outcome", "Remembered",
           "Store"]

SETTLE_AFTER = 0.05
"""Seconds within which a completion reply left unread (a store's ``complete_later``, read
on the worker's next claim) is read by the heartbeat thread instead."""


class Outcome(IntEnum):
    """What a transition did. The Lua scripts return these integers."""

    ACQUIRED = 1
    """reserve / claim / replace: the lock is now held by the caller's id."""
    DUPLICATE = 2
    """reserve / claim / replace: another id holds it (or it is done by this id)."""
    MISMATCH = 3
    """reserve / replace: an explicit key is held with a different argument digest."""
    OK = 4
    """heartbeat / complete / release: applied to a lock owned by the caller."""
    NOT_OWNER = 5
    """heartbeat / complete / release: the lock is absent or owned by someone else."""
    REPLACED = 6
    """replace: a queued original was displaced; ``owner`` is the displaced id."""
    COALESCED = 7
    """the fused enqueue under ``on_duplicate="coalesce"`` (SPEC §15): nothing was pushed;
    ``owner`` is the follow-up's id, whose message the caller publishes."""
    ALIVE = 8
    """the fused enqueue with a guard (RQ's explicit job id): a job of the caller's id
    exists and has not ended, so the call is a duplicate of it; nothing was written."""


class LockState(StrEnum):
    """The state recorded in a lock value (one character in Redis)."""

    QUEUED = "Q"
    RUNNING = "R"
    DONE = "D"
    FINISHED = "F"
    """A success that released the identity (``until_executed``, ``while_executing``) leaves
    a short tombstone: the owner's own copies (a redelivery, kombu's restored ETA copies) see
    it and end without running again; to every other call the identity is free."""


class LockResult(NamedTuple):
    """Result of a transition.

    ``owner`` and ``state`` describe the lock as found by the transition when it was not
    acquired (the original's id for a duplicate), or the displaced owner for ``REPLACED``.
    """

    outcome: Outcome
    owner: str | None = None
    state: LockState | None = None


class Remembered(NamedTuple):
    """Result of ``remember`` (success under an approximate window, SPEC §12).

    ``outcome`` as :meth:`Store.complete`; when OK and the identity went into the filter,
    ``added`` is how many identities the current slice (of this identity's partition) holds
    now, ``created`` whether this call started that slice, ``slice_index`` its time index.
    """

    outcome: Outcome
    added: int = 0
    created: bool = False
    slice_index: int = 0


class LockInfo(NamedTuple):
    """A lock as read by :meth:`Store.get` (for tools, not for decisions)."""

    key: str
    state: LockState
    owner: str
    check: str
    ttl_ms: int


@runtime_checkable
class Store(Protocol):
    """Atomic, owner-fenced transitions over lock keys.

    Implementations raise :class:`taskdedup.StoreUnavailableError` when the backend cannot
    be reached; they never swallow errors.
    """

    def reserve(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False
    ) -> LockResult:
        """Enqueue gate: absent → QUEUED(owner) for ``ttl_ms``.

        Same owner in QUEUED/RUNNING (a retry or a republish) → QUEUED(owner) with the
        expiry extended to at least ``ttl_ms``; ACQUIRED. DONE by the same owner, or held by
        another owner (in any state but FINISHED, which is free) → DUPLICATE. Held by another
        owner with a different non-empty
        ``check`` → MISMATCH. ``fresh``: a new call (not a retry or a republish of the
        owner's message) that reuses an explicit id; the owner's own lock in any state is
        then a DUPLICATE of itself.
        """
        ...

    def replace(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False
    ) -> LockResult:
        """Debounce: like reserve, but a QUEUED lock of another owner is taken over.

        Returns REPLACED with the displaced owner; RUNNING/DONE of another → DUPLICATE.
        """
        ...

    def claim(self, key: str, owner: str, lease_ms: int) -> LockResult:
        """Worker start: absent, another owner's FINISHED, or QUEUED by owner →
        RUNNING(owner) for ``lease_ms``.

        Held by another owner in any other state → DUPLICATE (skip). Held by this very owner
        RUNNING (another copy of the message runs now) or DONE/FINISHED (a redelivery after
        success) → DUPLICATE with that state and the owner: the caller defers the copy, or
        ends it without a new outcome.
        """
        ...

    def heartbeat(self, key: str, owner: str, lease_ms: int) -> Outcome:
        """Renew a RUNNING lock of ``owner`` to ``lease_ms``; OK or NOT_OWNER.

        A lock of ``owner`` in another state (re-reserved by a retry) is left as it is: OK.
        """
        ...

    def complete(self, key: str, owner: str, ttl_ms: int, *, finished_ms: int = 0) -> Outcome:
        """Success: RUNNING by ``owner`` → DONE(owner) for ``ttl_ms``; when ``ttl_ms`` is 0,
        FINISHED(owner) for ``finished_ms``, or deleted if that is 0 too.

        A lock of ``owner`` in another state is left as it is, OK: QUEUED means a retry
        re-reserved it while the body went on (``self.retry(throw=False)``), and that retry
        must still run; DONE, that it already completed.
        """
        ...

    def release(self, key: str, owner: str, *, only_queued: bool = False) -> Outcome:
        """Final failure, revoke, replace: owned by ``owner`` → deleted (compare-and-delete).

        ``only_queued``: release only a QUEUED lock (cancelling a job that has not started
        must not delete the lock its worker claimed in the meantime).
        """
        ...

    def get(self, key: str) -> LockInfo | None:
        """Read one lock, or None when absent."""
        ...

    # Approximate windows (SPEC §12), in RedisStore and MemoryStore beyond this protocol:
    # ``reserve``/``replace``/``claim`` take ``window=`` (a ``taskdedup.approximate.Probe``):
    # an absent lock whose identity a live slice remembers is then DUPLICATE with state DONE
    # and no owner; ``remember(key, owner, probe) -> Remembered`` is ``complete`` that deletes
    # the owner's RUNNING lock and adds the identity to the current slice instead.
