"""MemoryStore: the lock state machine in one process, for tests and demos.

Same semantics as :class:`~taskdedup.stores.RedisStore` (one contract suite runs over
both), with an injectable clock so expiry can be tested without sleeping. Values are kept
in the Redis value format, ``<state>|<check>|<owner>``, so a value "written by someone
else" (:meth:`MemoryStore.set_raw`) behaves exactly as it would in Redis.

This module also holds the value codec and the argument checks that RedisStore shares:
the pure-Python reference of what the Lua scripts do.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import LockInfo, LockResult, LockState, Outcome, Remembered
from .owners import COMPACT_MARK, looks_compact, owner_text

if TYPE_CHECKING:
    from ..approximate import Probe

__all__ = ["MemoryStore", "format_value", "parse_value"]

# The same grammar as ``parse`` in the Lua scripts: one state character, an empty or
# 32-hex check, and a non-empty owner that may contain anything (``|`` included); the
# string is split on its first two ``|`` only.
_VALUE = re.compile(r"([QRDF])\|((?:[0-9a-f]{32})?)\|(.+)", re.DOTALL)
_CHECK = re.compile(r"(?:[0-9a-f]{32})?")
_STATES = {state.value: state for state in LockState}
_ENDED = (LockState.DONE, LockState.FINISHED)

_Parsed = tuple[LockState, str, str]


def format_value(state: LockState, check: str, owner: str) -> str:
    """The stored value of a lock: ``"<state>|<check>|<owner>"``, e.g. ``"Q||task-1"``."""
    return f"{state.value}|{check}|{owner}"


def parse_value(raw: str | bytes | None) -> _Parsed | None:
    """Split a stored value into ``(state, check, owner)``.

    Returns None for a value taskdedup did not write (wrong state letter, a check that is
    not 32 lowercase hex digits, an empty owner, missing separators): callers treat such a
    lock as held by an unknown owner. Bytes are decoded as UTF-8 with ``surrogateescape``,
    so any byte string parses or fails cleanly, never raises.
    """
    if raw is None:
        return None
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "surrogateescape")
    match = _VALUE.fullmatch(raw)
    if match is None:
        return None
    state, check, owner = match.groups()
    return _STATES[state], check, owner_text(owner)


def check_owner(owner: str) -> None:
    """Refuse an owner that cannot be stored: it must be a non-empty ``str``, and not one
    that reads as a compact owner (``~`` and 22 base64url characters: every reader would
    take it for the UUID it encodes, :mod:`taskdedup.stores.owners`)."""
    if type(owner) is str and owner and owner[0] != COMPACT_MARK:
        return  # the common case, first: this runs on every claim and completion
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty task id string, got {owner!r}")
    if owner[0] == COMPACT_MARK and looks_compact(owner):
        raise ValueError(
            f"task id {owner!r} has the form taskdedup stores a UUID in (~ and 22 base64url "
            "characters) and would be read as that UUID: use another id")


def check_ms(name: str, value: int, *, allow_zero: bool = False) -> None:
    """Refuse a duration that Redis would reject: a positive ``int`` (or 0 when allowed)."""
    if type(value) is int and value > 0:
        return  # the common case, first
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int number of milliseconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        lowest = "0 or more" if allow_zero else "positive"
        raise ValueError(f"{name} must be {lowest} milliseconds, got {value}")


def check_check(check: str) -> None:
    """Refuse an argument digest that is neither empty nor 32 lowercase hex digits."""
    if not isinstance(check, str) or _CHECK.fullmatch(check) is None:
        raise ValueError(f"check must be '' or a 32-character lowercase hex digest, got {check!r}")


@dataclass(slots=True)
class _Slice:
    bits: bytearray
    expires: float
    added: int
    origin: int


class MemoryStore:
    """An in-process :class:`~taskdedup.stores.Store`, thread-safe, with an injectable clock.

    Expired entries behave as absent (they are dropped when next touched). Use it in unit
    tests of code that takes a store, and in your own tests instead of a Redis server::

        clock = FakeClock()                # any callable returning seconds as a float
        store = MemoryStore(clock=clock)
        store.reserve("k", "task-1", ttl_ms=1000)
        clock.advance(1.0)                 # the reservation has now expired

    Args:
        clock: returns the current time in seconds (``time.monotonic`` by default).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (raw value, absolute expiry in clock seconds, math.inf for none)
        self._data: dict[str, tuple[str, float]] = {}
        # approximate windows: slice key -> its bitmap and tail
        self._slices: dict[str, _Slice] = {}
        # per-key limits: a limit's set -> member -> score (clock seconds)
        self._zsets: dict[str, dict[str, float]] = {}

    def __repr__(self) -> str:
        return f"<MemoryStore {len(self._data)} keys>"

    def clear(self) -> None:
        """Forget every lock, window and limit: the store as new (for a test reusing one)."""
        with self._lock:
            self._data.clear()
            self._slices.clear()
            self._zsets.clear()

    # -- internals (call with self._lock held) ----------------------------------------------

    def _read(self, key: str, now: float) -> tuple[str, float] | None:
        entry = self._data.get(key)
        if entry is not None and entry[1] <= now:
            del self._data[key]
            return None
        return entry

    def _write(self, key: str, state: LockState, check: str, owner: str, expires: float) -> None:
        self._data[key] = (format_value(state, check, owner), expires)

    def _slice(self, key: str, now: float) -> _Slice | None:
        entry = self._slices.get(key)
        if entry is not None and entry.expires <= now:
            del self._slices[key]
            return None
        return entry

    def _held(self, window: Probe, positions: list[int], now: float) -> bool:
        """Whether a live slice of ``window`` has every bit of ``positions`` set."""
        for slice_key in window.keys(int(now * 1000)):
            entry = self._slice(slice_key, now)
            if entry is None:
                continue
            bitmap = entry.bits
            if all(bitmap[p >> 3] & (0x80 >> (p & 7)) for p in positions):
                return True
        return False

    def _seen(self, window: Probe | None, now: float, check: str = "") -> LockResult | None:
        """The answer for an absent lock under ``window`` (``seen`` in ``_lib.lua``):
        DUPLICATE when a live slice remembers the identity, MISMATCH when ``check`` (an
        explicit key's argument digest) is not remembered with it; None to go on."""
        if window is None:
            return None
        if not self._held(window, [int(p) for p in window.positions.split(",")], now):
            return None
        if check and not self._held(window, window.check_positions(check), now):
            return LockResult(Outcome.MISMATCH, None, LockState.DONE)
        return LockResult(Outcome.DUPLICATE, None, LockState.DONE)

    def _reserve(
        self, key: str, owner: str, ttl_ms: int, check: str, now: float, replace: bool,
        fresh: bool = False, window: Probe | None = None,
    ) -> LockResult:
        entry = self._free(key, owner, now)
        expires = now + ttl_ms / 1000
        if entry is None:
            known = self._seen(window, now, check)
            if known is not None:
                return known
            self._write(key, LockState.QUEUED, check, owner, expires)
            return LockResult(Outcome.ACQUIRED)
        parsed = parse_value(entry[0])
        if parsed is None:
            return LockResult(Outcome.DUPLICATE)
        state, held_check, held_owner = parsed
        if held_owner == owner:
            if state in _ENDED or fresh:
                return LockResult(Outcome.DUPLICATE, held_owner, state)
            # Never shorten; an entry without expiry (set by hand) gets ttl_ms, as in Lua.
            if entry[1] != math.inf:
                expires = max(expires, entry[1])
            self._write(key, LockState.QUEUED, held_check, owner, expires)
            return LockResult(Outcome.ACQUIRED)
        if check and held_check and check != held_check:
            return LockResult(Outcome.MISMATCH, held_owner, state)
        if replace and state is LockState.QUEUED:
            self._write(key, LockState.QUEUED, check, owner, expires)
            return LockResult(Outcome.REPLACED, held_owner, state)
        return LockResult(Outcome.DUPLICATE, held_owner, state)

    def _free(self, key: str, owner: str, now: float) -> tuple[str, float] | None:
        """The entry at ``key``, or None when absent or another owner's FINISHED tombstone
        (free to every call but its owner's copies), as the scripts read it."""
        entry = self._read(key, now)
        if entry is not None:
            parsed = parse_value(entry[0])
            if parsed is not None and parsed[0] is LockState.FINISHED and parsed[2] != owner:
                return None
        return entry

    def _owned(self, key: str, owner: str, now: float) -> tuple[_Parsed, float] | None:
        entry = self._read(key, now)
        if entry is None:
            return None
        parsed = parse_value(entry[0])
        if parsed is None or parsed[2] != owner:
            return None
        return parsed, entry[1]

    # -- the Store protocol -----------------------------------------------------------------

    def reserve(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False,
        window: Probe | None = None,
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.reserve` (``window``: as RedisStore's)."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms)
        check_check(check)
        with self._lock:
            return self._reserve(key, owner, ttl_ms, check, self._clock(), replace=False,
                                 fresh=fresh, window=window)

    def replace(
        self, key: str, owner: str, ttl_ms: int, check: str = "", *, fresh: bool = False,
        window: Probe | None = None,
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.replace` (``window``: as RedisStore's)."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms)
        check_check(check)
        with self._lock:
            return self._reserve(key, owner, ttl_ms, check, self._clock(), replace=True,
                                 fresh=fresh, window=window)

    def claim(
        self, key: str, owner: str, lease_ms: int, *, window: Probe | None = None
    ) -> LockResult:
        """See :meth:`taskdedup.stores.Store.claim` (``window``: as RedisStore's)."""
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        with self._lock:
            now = self._clock()
            entry = self._free(key, owner, now)
            expires = now + lease_ms / 1000
            if entry is None:
                known = self._seen(window, now)
                if known is not None:
                    return known
                self._write(key, LockState.RUNNING, "", owner, expires)
                return LockResult(Outcome.ACQUIRED)
            parsed = parse_value(entry[0])
            if parsed is None:
                return LockResult(Outcome.DUPLICATE)
            state, held_check, held_owner = parsed
            if held_owner == owner and state is LockState.QUEUED:
                self._write(key, LockState.RUNNING, held_check, owner, expires)
                return LockResult(Outcome.ACQUIRED)
            return LockResult(Outcome.DUPLICATE, held_owner, state)

    def heartbeat(self, key: str, owner: str, lease_ms: int) -> Outcome:
        """See :meth:`taskdedup.stores.Store.heartbeat`."""
        check_owner(owner)
        check_ms("lease_ms", lease_ms)
        with self._lock:
            now = self._clock()
            owned = self._owned(key, owner, now)
            if owned is None:
                return Outcome.NOT_OWNER
            (state, check, _), _ = owned
            if state is LockState.RUNNING:
                self._write(key, state, check, owner, now + lease_ms / 1000)
            return Outcome.OK

    def complete(self, key: str, owner: str, ttl_ms: int, *, finished_ms: int = 0) -> Outcome:
        """See :meth:`taskdedup.stores.Store.complete`."""
        check_owner(owner)
        check_ms("ttl_ms", ttl_ms, allow_zero=True)
        check_ms("finished_ms", finished_ms, allow_zero=True)
        with self._lock:
            now = self._clock()
            owned = self._owned(key, owner, now)
            if owned is None:
                return Outcome.NOT_OWNER
            if owned[0][0] is not LockState.RUNNING:  # a pending retry's Q, or already done
                return Outcome.OK
            if ttl_ms > 0:
                self._write(key, LockState.DONE, owned[0][1], owner, now + ttl_ms / 1000)
            elif finished_ms > 0:
                self._write(key, LockState.FINISHED, owned[0][1], owner,
                            now + finished_ms / 1000)
            else:
                del self._data[key]
            return Outcome.OK

    def remember(
        self, key: str, owner: str, window: Probe, *, finished_ms: int = 0
    ) -> Remembered:
        """See :meth:`taskdedup.stores.RedisStore.remember` (``complete.lua``)."""
        check_owner(owner)
        check_ms("finished_ms", finished_ms, allow_zero=True)
        with self._lock:
            now = self._clock()
            owned = self._owned(key, owner, now)
            if owned is None:
                return Remembered(Outcome.NOT_OWNER)
            if owned[0][0] is not LockState.RUNNING:
                return Remembered(Outcome.OK)
            if finished_ms > 0:
                self._write(key, LockState.FINISHED, owned[0][1], owner,
                            now + finished_ms / 1000)
            else:
                del self._data[key]
            now_ms = int(now * 1000)
            index = window.index(now_ms)
            keys = window.keys(now_ms)
            entry = self._slice(keys[0], now)
            created = entry is None
            if entry is None:
                origin = index
                for older in keys[1:]:
                    previous = self._slice(older, now)
                    if previous is not None:
                        origin = previous.origin
                        break
                entry = _Slice(bytearray(window.window.bits // 8),
                               window.expire_at_ms(index) / 1000, 0, origin)
                self._slices[keys[0]] = entry
            bitmap = entry.bits
            added = [[int(p) for p in window.positions.split(",")]]
            if owned[0][1]:  # an explicit key's check: the pair too (SPEC §3)
                added.append(window.check_positions(owned[0][1]))
            for positions in added:
                new = False
                for p in positions:
                    mask = 0x80 >> (p & 7)
                    if not bitmap[p >> 3] & mask:
                        bitmap[p >> 3] |= mask
                        new = True
                if new:
                    entry.added += 1
            return Remembered(Outcome.OK, entry.added, created, index)

    def slices(self) -> dict[str, tuple[bytes, int, int]]:
        """The live slice bitmaps: key -> (bits, identities added, first index counted), for
        tests and stats (the Redis layout without its tail)."""
        with self._lock:
            now = self._clock()
            live = {key: self._slice(key, now) for key in list(self._slices)}
        return {key: (bytes(e.bits), e.added, e.origin) for key, e in live.items()
                if e is not None}

    def release(self, key: str, owner: str, *, only_queued: bool = False) -> Outcome:
        """See :meth:`taskdedup.stores.Store.release`."""
        check_owner(owner)
        with self._lock:
            owned = self._owned(key, owner, self._clock())
            if owned is None or (only_queued and owned[0][0] is not LockState.QUEUED):
                return Outcome.NOT_OWNER
            del self._data[key]
            return Outcome.OK

    # -- per-key limits (the contract of RedisStore's limit scripts) -------------------------

    def _zset(self, key: str, now: float) -> dict[str, float]:
        """The live members of a limit's set (member -> score in clock seconds); lapsed
        ones are dropped as the scripts drop them."""
        members = self._zsets.get(key)
        if members is None:
            members = self._zsets[key] = {}
        return members

    def slot_acquire(self, key: str, holder: str, limit: int, lease_ms: int) -> tuple[bool, int]:
        """See :meth:`taskdedup.stores.RedisStore.slot_acquire`."""
        check_owner(holder)
        check_ms("lease_ms", lease_ms)
        with self._lock:
            now = self._clock()
            slots = self._zset(key, now)
            for member in [m for m, until in slots.items() if until <= now]:
                del slots[member]
            if holder in slots or len(slots) < limit:
                slots[holder] = now + lease_ms / 1000
                return True, len(slots)
            return False, max(1, round((min(slots.values()) - now) * 1000))

    def slot_heartbeat(self, key: str, holder: str, lease_ms: int) -> Outcome:
        """See :meth:`taskdedup.stores.RedisStore.slot_heartbeat`."""
        check_owner(holder)
        check_ms("lease_ms", lease_ms)
        with self._lock:
            now = self._clock()
            slots = self._zset(key, now)
            until = slots.get(holder)
            if until is None or until <= now:
                slots.pop(holder, None)
                return Outcome.NOT_OWNER
            slots[holder] = now + lease_ms / 1000
            return Outcome.OK

    def slot_release(self, key: str, holder: str) -> Outcome:
        """See :meth:`taskdedup.stores.RedisStore.slot_release`."""
        check_owner(holder)
        with self._lock:
            slots = self._zsets.get(key, {})
            return Outcome.OK if slots.pop(holder, None) is not None else Outcome.NOT_OWNER

    def rate_acquire(self, key: str, member: str, limit: int, per_ms: int) -> tuple[bool, int]:
        """See :meth:`taskdedup.stores.RedisStore.rate_acquire`."""
        check_owner(member)
        check_ms("per_ms", per_ms)
        with self._lock:
            now = self._clock()
            starts = self._zset(key, now)
            per = per_ms / 1000
            for old in [m for m, at in starts.items() if at <= now - per]:
                del starts[old]
            if len(starts) < limit:
                starts[member] = now
                return True, len(starts)
            return False, max(1, round((min(starts.values()) + per - now) * 1000))

    def slot_count(self, key: str) -> int:
        """Live members of a limit's set (what ``ZCOUNT key now +inf`` says in Redis)."""
        with self._lock:
            now = self._clock()
            return sum(1 for until in self._zsets.get(key, {}).values() if until > now)

    def get(self, key: str) -> LockInfo | None:
        """Read one lock, or None when absent or not written by taskdedup.

        ``ttl_ms`` is the remaining time in whole milliseconds, -1 for no expiry (only
        possible through :meth:`set_raw`).
        """
        with self._lock:
            now = self._clock()
            entry = self._read(key, now)
        if entry is None:
            return None
        parsed = parse_value(entry[0])
        if parsed is None:
            return None
        state, check, owner = parsed
        ttl_ms = -1 if entry[1] == math.inf else max(1, math.ceil((entry[1] - now) * 1000))
        return LockInfo(key, state, owner, check, ttl_ms)

    # -- beyond the protocol (RedisStore has the same) -------------------------------------

    def reserve_many(
        self, items: Sequence[tuple[str, str, int, str]], *, fresh: bool = False,
        windows: Sequence[Probe | None] | None = None,
    ) -> list[LockResult]:
        """:meth:`reserve` each ``(key, owner, ttl_ms, check)``; one result per item, in order.
        ``fresh`` applies to every item (see :meth:`taskdedup.stores.Store.reserve`);
        ``windows``: as RedisStore's.

        All items are checked first, then reserved under one lock acquisition (atomic as a
        batch here; RedisStore only promises each item is atomic).
        """
        for _, owner, ttl_ms, check in items:
            check_owner(owner)
            check_ms("ttl_ms", ttl_ms)
            check_check(check)
        if windows is not None and len(windows) != len(items):
            raise ValueError("reserve_many: one window (or None) per item")
        probes = [None] * len(items) if windows is None else windows
        with self._lock:
            now = self._clock()
            return [
                self._reserve(key, owner, ttl_ms, check, now, replace=False, fresh=fresh,
                              window=window)
                for (key, owner, ttl_ms, check), window in zip(items, probes, strict=True)
            ]

    def scan(self, match_prefix: str, count: int = 1000) -> Iterator[str]:
        """Yield the live keys that start with ``match_prefix`` (``count`` is ignored).

        The keys are taken as a snapshot, so the store may be changed while iterating.
        """
        with self._lock:
            now = self._clock()
            keys = [
                key
                for key, (_, expires) in self._data.items()
                if expires > now and key.startswith(match_prefix)
            ]
        return iter(keys)

    def close(self) -> None:
        """Nothing to close; present so code can close any store."""

    # -- test hooks --------------------------------------------------------------------------

    def set_raw(self, key: str, value: str, ttl_ms: int | None = None) -> None:
        """Store ``value`` verbatim, as another program writing to the key would.

        Use it to test how code copes with locks it did not write (a malformed value is
        treated as held by an unknown owner). ``ttl_ms=None`` means no expiry.
        """
        with self._lock:
            now = self._clock()
            expires = math.inf if ttl_ms is None else now + ttl_ms / 1000
            self._data[key] = (value, expires)

    def get_raw(self, key: str) -> str | None:
        """The stored value of ``key`` verbatim (the Redis value format), or None if absent."""
        with self._lock:
            entry = self._read(key, self._clock())
        return None if entry is None else entry[0]
